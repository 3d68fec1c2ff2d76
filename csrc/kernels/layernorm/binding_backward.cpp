// Registers the backward kernels as the raw op tk_cuda::layernorm_backward (binding.h).
#include "binding.h"

namespace tk_layernorm_binding {
namespace {

// dres has h's dtype, dx x_dtype (h's by default; empty when it would equal dres), dw/db the weight's. With a
// gate, h is x (h = x·silu(gate) is recomputed): dres is empty, dx has x's dtype and dgate the gate's.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_backward(
    const Tensor& dy_in, const OptTensor& dh_in, const Tensor& h_in, const OptTensor& weight_in, const Tensor& mean_in,
    const Tensor& rstd_in, const Tensor& rng, double p, bool rms, bool has_bias, std::optional<at::ScalarType> x_dtype,
    const OptTensor& dy2_in, const OptTensor& dy3_in, const OptTensor& gate_in) {
  TORCH_CHECK(h_in.is_cuda() && h_in.dim() >= 1, "tk_cuda::layernorm_backward: h must be a CUDA tensor");
  const Tensor dy = binding::dense(dy_in), h = binding::dense(h_in);
  const Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const OptTensor dh = contig(dh_in), weight = contig(weight_in), dy2 = contig(dy2_in), dy3 = contig(dy3_in);
  const OptTensor gate = contig(gate_in);
  const bool gated = present(gate);
  const int64_t hidden = h.size(-1);
  TORCH_CHECK(hidden % 8 == 0 && hidden > 0 && hidden <= tk_layernorm::kMaxHidden,
              "tk_cuda::layernorm_backward: hidden size must be a multiple of 8 in [8, 16384], got ", hidden);
  check_operand(h, h, h.numel(), "h");
  check_operand(dy, h, h.numel(), "dy");
  check_operand(dh, h, h.numel(), "dh");
  check_operand(dy2, h, h.numel(), "dy2");
  check_operand(dy3, h, h.numel(), "dy3");
  TORCH_CHECK(!present(dy3) || present(dy2), "tk_cuda::layernorm_backward: dy3 without dy2");
  for (const OptTensor& t : {dy2, dy3})
    TORCH_CHECK(!present(t) || t->scalar_type() == dy.scalar_type(), "tk_cuda::layernorm_backward: dy2/dy3 must have dy's dtype");
  check_operand(weight, h, hidden, "weight");
  check_operand(gate, h, h.numel(), "gate");
  TORCH_CHECK(!present(dh) || dh->scalar_type() == h.scalar_type(), "tk_cuda::layernorm_backward: dh must have h's dtype");
  TORCH_CHECK(!gated || (!present(dh) && p == 0.0), "tk_cuda::layernorm_backward: a gated norm takes no dh or dropout");
  const int64_t rows = h.numel() / hidden;
  TORCH_CHECK(rstd.is_cuda() && rstd.scalar_type() == at::kFloat && rstd.is_contiguous() && rstd.numel() == rows,
              "tk_cuda::layernorm_backward: rstd must be fp32 CUDA (rows,)");
  TORCH_CHECK(rms || (mean.is_cuda() && mean.scalar_type() == at::kFloat && mean.is_contiguous() && mean.numel() == rows),
              "tk_cuda::layernorm_backward: mean must be fp32 CUDA (rows,)");
  TORCH_CHECK(!(rms && has_bias), "tk_cuda::layernorm_backward: RMSNorm takes no bias");
  const at::ScalarType x_type = gated ? h.scalar_type() : x_dtype.value_or(h.scalar_type());
  const std::optional<at::ScalarType> w_type = present(weight) ? std::optional(weight->scalar_type()) : std::nullopt;
  const tk_layernorm::DTypes dtypes = gated ? gated_dtypes(x_type, w_type, dy.scalar_type())
                                            : dtypes_of(x_type, h.scalar_type(), w_type, dy.scalar_type());
  const auto w_options = h.options().dtype(dtypes.w == tk_layernorm::DType::f32 ? at::kFloat : w_type.value_or(dy.scalar_type()));
  const c10::cuda::CUDAGuard guard(h.device());
  const bool has_weight = present(weight);

  // dx of its own with dropout, or where x is narrower than h (dres cast, in the same pass); else dx is dres.
  const bool own_dx = p > 0.0 || x_type != h.scalar_type() || gated;
  Tensor dres = gated ? at::empty({0}, h.options().dtype(at::kFloat)) : at::empty(h.sizes(), h.options());
  Tensor dx = own_dx ? at::empty(h.sizes(), h.options().dtype(x_type)) : at::empty({0}, h.options().dtype(x_type));
  Tensor dgate = gated ? at::empty(h.sizes(), gate->options()) : at::empty({0}, h.options());
  Tensor dw = at::empty({has_weight ? hidden : 0}, w_options);
  Tensor db = at::empty({has_bias ? hidden : 0}, w_options);

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
  a.mean = rms ? nullptr : mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.rows = rows;
  a.hidden = static_cast<int>(hidden);
  a.rms = rms;
  a.dropout = dropout_args(p, rng);
  a.dtypes = dtypes;
  // The grid (and so the partial buffer) depends on the hidden size, the dtypes and which operands are present.
  const int blocks = tk_layernorm::backward_blocks(a);
  TORCH_CHECK(blocks > 0, "tk_cuda::layernorm_backward: no launch configuration");
  Tensor partial = (has_weight || has_bias) ? at::empty({2, blocks, hidden}, h.options().dtype(at::kFloat))
                                            : at::empty({0}, h.options().dtype(at::kFloat));
  a.partial = partial.numel() ? partial.data_ptr<float>() : nullptr;
  const cudaError_t err = tk_layernorm::backward(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "tk_cuda::layernorm_backward: launch failed: ", cudaGetErrorString(err));
  return {dres, dx, dw, db, dgate};
}

}  // namespace
}  // namespace tk_layernorm_binding

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("layernorm_backward(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, Tensor rng, "
        "float p, bool rms, bool has_bias, ScalarType? x_dtype=None, Tensor? dy2=None, Tensor? dy3=None, "
        "Tensor? gate=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) { m.impl("layernorm_backward", &tk_layernorm_binding::layernorm_backward); }
