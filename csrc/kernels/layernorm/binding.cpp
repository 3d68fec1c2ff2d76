// Registers the layernorm kernels as raw ops tk_cuda::layernorm / tk_cuda::layernorm_backward, with the
// schemas of the user-facing tk:: ops (tk_inductor/ops/layernorm.py validates inputs before calling here).
#include "binding/stable.h"

#include <cmath>
#include <optional>
#include <tuple>

#include "layernorm.h"

namespace {

using binding::dtype_name;
using binding::OptTensor;
using binding::present;
using binding::ScalarType;
using binding::Tensor;
using torch::stable::new_empty;

tk_layernorm::DType dtype_of(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return tk_layernorm::DType::f32;
    case ScalarType::Half: return tk_layernorm::DType::f16;
    case ScalarType::BFloat16: return tk_layernorm::DType::bf16;
    default: STD_TORCH_CHECK(false, "tk_cuda::layernorm: unsupported dtype ", dtype_name(t));
  }
  return tk_layernorm::DType::f32;
}

const void* ptr_or_null(const OptTensor& t) { return present(t) ? t->data_ptr() : nullptr; }
float* floats(const Tensor& t) { return static_cast<float*>(t.data_ptr()); }

void check_operand(const OptTensor& t, const Tensor& x, int64_t numel, const char* name) {
  if (!present(t)) return;
  STD_TORCH_CHECK(t->is_cuda() && t->get_device_index() == x.get_device_index(), "tk_cuda::layernorm: ", name,
                  " must be on cuda:", x.get_device_index());
  STD_TORCH_CHECK(t->is_contiguous() && t->numel() == numel, "tk_cuda::layernorm: ", name, " must be contiguous with ",
                  numel, " elements");
  STD_TORCH_CHECK(binding::aligned16(*t), "tk_cuda::layernorm: ", name, " must be 16-byte aligned");
}

// The call's dtypes (layernorm.h DTypes). Without a weight or bias their dtype is free: the output's where the
// kernels take that combination, fp32 otherwise.
tk_layernorm::DTypes dtypes_of(ScalarType x, ScalarType h, std::optional<ScalarType> w, ScalarType y) {
  tk_layernorm::DTypes t{dtype_of(x), dtype_of(h), dtype_of(w.value_or(y)), dtype_of(y)};
  if (!w && !tk_layernorm::supported(t)) t.w = tk_layernorm::DType::f32;
  STD_TORCH_CHECK(tk_layernorm::supported(t), "tk_cuda::layernorm: no kernel for x ", dtype_name(x), ", residual/h ",
                  dtype_name(h), ", weight ", w ? dtype_name(*w) : "(none)", ", output ", dtype_name(y));
  return t;
}

// A gated call's dtypes: h is fp32, x any; the kernels are those of (fp32, fp32, w, y) (layernorm.h gate_supported).
tk_layernorm::DTypes gated_dtypes(ScalarType x, std::optional<ScalarType> w, ScalarType y) {
  tk_layernorm::DTypes t{dtype_of(x), tk_layernorm::DType::f32, dtype_of(w.value_or(y)), dtype_of(y)};
  if (!w && !tk_layernorm::gate_supported(t.w, t.y)) t.w = tk_layernorm::DType::f32;
  STD_TORCH_CHECK(tk_layernorm::gate_supported(t.w, t.y), "tk_cuda::layernorm: no gated kernel for weight ",
                  w ? dtype_name(*w) : "(none)", ", output ", dtype_name(y));
  return t;
}

std::optional<ScalarType> weight_dtype(const OptTensor& weight, const OptTensor& bias) {
  if (present(weight) && present(bias))
    STD_TORCH_CHECK(weight->scalar_type() == bias->scalar_type(), "tk_cuda::layernorm: weight and bias must have one dtype");
  if (present(weight)) return weight->scalar_type();
  if (present(bias)) return bias->scalar_type();
  return std::nullopt;
}

tk_layernorm::DropoutArgs dropout_args(double p, const OptTensor& rng) {
  return binding::philox<tk_layernorm::DropoutArgs>("tk_cuda::layernorm", p, rng);
}

// y's dtype is out_dtype, or h's: the residual's, or x's without one (fp32 with a gate).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm(const Tensor& x_in, const OptTensor& residual_in,
                                                             const OptTensor& weight_in, const OptTensor& bias_in,
                                                             const OptTensor& rng, double eps, double p, bool rms,
                                                             bool stats, std::optional<ScalarType> out_dtype,
                                                             const OptTensor& gate_in) {
  STD_TORCH_CHECK(x_in.is_cuda() && x_in.dim() >= 1, "tk_cuda::layernorm: x must be a CUDA tensor");
  const Tensor x = binding::dense(x_in);
  const OptTensor residual = binding::dense(residual_in), weight = binding::dense(weight_in);
  const OptTensor bias = binding::dense(bias_in), gate = binding::dense(gate_in);
  const int64_t hidden = x.size(-1);
  STD_TORCH_CHECK(hidden % 8 == 0 && hidden > 0 && hidden <= tk_layernorm::kMaxHidden,
              "tk_cuda::layernorm: hidden size must be a multiple of 8 in [8, 16384], got ", hidden);
  check_operand(x, x, x.numel(), "x");
  check_operand(residual, x, x.numel(), "residual");
  check_operand(weight, x, hidden, "weight");
  check_operand(bias, x, hidden, "bias");
  check_operand(gate, x, x.numel(), "gate");
  STD_TORCH_CHECK(!(rms && present(bias)), "tk_cuda::layernorm: RMSNorm takes no bias");
  STD_TORCH_CHECK(!present(gate) || (!present(residual) && p == 0.0),
              "tk_cuda::layernorm: a gated norm takes no residual or dropout");
  const ScalarType h_type = present(gate) ? ScalarType::Float : present(residual) ? residual->scalar_type() : x.scalar_type();
  const ScalarType y_type = out_dtype.value_or(h_type);
  const tk_layernorm::DTypes dtypes = present(gate) ? gated_dtypes(x.scalar_type(), weight_dtype(weight, bias), y_type)
                                                    : dtypes_of(x.scalar_type(), h_type, weight_dtype(weight, bias), y_type);
  const binding::DeviceGuard guard(x.get_device_index());
  const int64_t rows = x.numel() / hidden;
  const bool store_h = present(residual) || p > 0.0;

  Tensor y = new_empty(x, x.sizes(), y_type);
  Tensor h = new_empty(x, store_h ? x.sizes() : binding::Sizes{0}, h_type);
  // Without stats (inference) mean and rstd are empty and never written: at hidden 1024 their 8 bytes a row,
  // written a row per block, cost ~1% of the forward (H200).
  Tensor mean = new_empty(x, {rms || !stats ? 0 : rows}, ScalarType::Float);
  Tensor rstd = new_empty(x, {stats ? rows : 0}, ScalarType::Float);
  const tk_layernorm::DropoutArgs dropout = dropout_args(p, rng);  // validates rng before it is read
  Tensor rng_out = p > 0.0 ? torch::stable::clone(*rng) : binding::cpu_zeros(2, ScalarType::Long);

  tk_layernorm::ForwardArgs a{};
  a.y = y.data_ptr();
  a.h = store_h ? h.data_ptr() : nullptr;
  a.mean = rms || !stats ? nullptr : floats(mean);
  a.rstd = stats ? floats(rstd) : nullptr;
  a.x = x.data_ptr();
  a.residual = ptr_or_null(residual);
  a.weight = ptr_or_null(weight);
  a.bias = ptr_or_null(bias);
  a.gate = ptr_or_null(gate);
  a.gate_dtype = present(gate) ? dtype_of(gate->scalar_type()) : tk_layernorm::DType::f32;
  a.rows = rows;
  a.hidden = static_cast<int>(hidden);
  a.eps = static_cast<float>(eps);
  a.rms = rms;
  a.dropout = dropout;
  a.dtypes = dtypes;
  const cudaError_t err = tk_layernorm::forward(a, binding::current_stream(x));
  STD_TORCH_CHECK(err == cudaSuccess, "tk_cuda::layernorm: launch failed: ", cudaGetErrorString(err));
  return {y, h, mean, rstd, rng_out};
}

// dres has h's dtype, dx x_dtype (h's by default; empty when it would equal dres), dw/db the weight's. With a
// gate, h is x (h = x·silu(gate) is recomputed): dres is empty, dx has x's dtype and dgate the gate's.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_backward(
    const Tensor& dy_in, const OptTensor& dh_in, const Tensor& h_in, const OptTensor& weight_in, const Tensor& mean_in,
    const Tensor& rstd_in, const Tensor& rng, double p, bool rms, bool has_bias, std::optional<ScalarType> x_dtype,
    const OptTensor& dy2_in, const OptTensor& dy3_in, const OptTensor& gate_in) {
  STD_TORCH_CHECK(h_in.is_cuda() && h_in.dim() >= 1, "tk_cuda::layernorm_backward: h must be a CUDA tensor");
  const Tensor dy = binding::dense(dy_in), h = binding::dense(h_in);
  const Tensor mean = torch::stable::contiguous(mean_in), rstd = torch::stable::contiguous(rstd_in);
  const OptTensor dh = binding::dense(dh_in), weight = binding::dense(weight_in);
  const OptTensor dy2 = binding::dense(dy2_in), dy3 = binding::dense(dy3_in), gate = binding::dense(gate_in);
  const bool gated = present(gate);
  const int64_t hidden = h.size(-1);
  STD_TORCH_CHECK(hidden % 8 == 0 && hidden > 0 && hidden <= tk_layernorm::kMaxHidden,
              "tk_cuda::layernorm_backward: hidden size must be a multiple of 8 in [8, 16384], got ", hidden);
  check_operand(h, h, h.numel(), "h");
  check_operand(dy, h, h.numel(), "dy");
  check_operand(dh, h, h.numel(), "dh");
  check_operand(dy2, h, h.numel(), "dy2");
  check_operand(dy3, h, h.numel(), "dy3");
  STD_TORCH_CHECK(!present(dy3) || present(dy2), "tk_cuda::layernorm_backward: dy3 without dy2");
  for (const OptTensor& t : {dy2, dy3})
    STD_TORCH_CHECK(!present(t) || t->scalar_type() == dy.scalar_type(), "tk_cuda::layernorm_backward: dy2/dy3 must have dy's dtype");
  check_operand(weight, h, hidden, "weight");
  check_operand(gate, h, h.numel(), "gate");
  STD_TORCH_CHECK(!present(dh) || dh->scalar_type() == h.scalar_type(), "tk_cuda::layernorm_backward: dh must have h's dtype");
  STD_TORCH_CHECK(!gated || (!present(dh) && p == 0.0), "tk_cuda::layernorm_backward: a gated norm takes no dh or dropout");
  const int64_t rows = h.numel() / hidden;
  STD_TORCH_CHECK(rstd.is_cuda() && rstd.scalar_type() == ScalarType::Float && rstd.is_contiguous() && rstd.numel() == rows,
              "tk_cuda::layernorm_backward: rstd must be fp32 CUDA (rows,)");
  STD_TORCH_CHECK(rms || (mean.is_cuda() && mean.scalar_type() == ScalarType::Float && mean.is_contiguous() && mean.numel() == rows),
              "tk_cuda::layernorm_backward: mean must be fp32 CUDA (rows,)");
  STD_TORCH_CHECK(!(rms && has_bias), "tk_cuda::layernorm_backward: RMSNorm takes no bias");
  const ScalarType x_type = gated ? h.scalar_type() : x_dtype.value_or(h.scalar_type());
  const std::optional<ScalarType> w_type = present(weight) ? std::optional(weight->scalar_type()) : std::nullopt;
  const tk_layernorm::DTypes dtypes = gated ? gated_dtypes(x_type, w_type, dy.scalar_type())
                                            : dtypes_of(x_type, h.scalar_type(), w_type, dy.scalar_type());
  const ScalarType w_out = dtypes.w == tk_layernorm::DType::f32 ? ScalarType::Float : w_type.value_or(dy.scalar_type());
  const binding::DeviceGuard guard(h.get_device_index());
  const bool has_weight = present(weight);

  // dx of its own with dropout, or where x is narrower than h (dres cast, in the same pass); else dx is dres.
  const bool own_dx = p > 0.0 || x_type != h.scalar_type() || gated;
  const binding::Sizes none{0};
  Tensor dres = gated ? new_empty(h, none, ScalarType::Float) : new_empty(h, h.sizes(), h.scalar_type());
  Tensor dx = new_empty(h, own_dx ? h.sizes() : none, x_type);
  Tensor dgate = gated ? new_empty(h, h.sizes(), gate->scalar_type()) : new_empty(h, none, h.scalar_type());
  Tensor dw = new_empty(h, {has_weight ? hidden : 0}, w_out);
  Tensor db = new_empty(h, {has_bias ? hidden : 0}, w_out);

  tk_layernorm::BackwardArgs a{};
  a.dres = gated ? nullptr : dres.data_ptr();
  a.dx = own_dx ? dx.data_ptr() : nullptr;
  a.dgate = gated ? dgate.data_ptr() : nullptr;
  a.gate = ptr_or_null(gate);
  a.gate_dtype = gated ? dtype_of(gate->scalar_type()) : tk_layernorm::DType::f32;
  a.dw = has_weight ? dw.data_ptr() : nullptr;
  a.db = has_bias ? db.data_ptr() : nullptr;
  a.dy = dy.data_ptr();
  a.dy_more[0] = ptr_or_null(dy2);
  a.dy_more[1] = ptr_or_null(dy3);
  a.dh = ptr_or_null(dh);
  a.h = h.data_ptr();
  a.weight = ptr_or_null(weight);
  a.mean = rms ? nullptr : floats(mean);
  a.rstd = floats(rstd);
  a.rows = rows;
  a.hidden = static_cast<int>(hidden);
  a.rms = rms;
  a.dropout = dropout_args(p, rng);
  a.dtypes = dtypes;
  // The grid (and so the partial buffer) depends on the hidden size, the dtypes and which operands are present.
  const int blocks = tk_layernorm::backward_blocks(a);
  STD_TORCH_CHECK(blocks > 0, "tk_cuda::layernorm_backward: no launch configuration");
  Tensor partial = new_empty(h, (has_weight || has_bias) ? binding::Sizes{2, blocks, hidden} : none, ScalarType::Float);
  a.partial = partial.numel() ? floats(partial) : nullptr;
  const cudaError_t err = tk_layernorm::backward(a, binding::current_stream(h));
  STD_TORCH_CHECK(err == cudaSuccess, "tk_cuda::layernorm_backward: launch failed: ", cudaGetErrorString(err));
  return {dres, dx, dw, db, dgate};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("layernorm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, Tensor? rng, float eps, float p, bool rms, "
        "bool stats=True, ScalarType? out_dtype=None, Tensor? gate=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("layernorm_backward(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, Tensor rng, "
        "float p, bool rms, bool has_bias, ScalarType? x_dtype=None, Tensor? dy2=None, Tensor? dy3=None, "
        "Tensor? gate=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("layernorm", TORCH_BOX(&layernorm));
  m.impl("layernorm_backward", TORCH_BOX(&layernorm_backward));
}
