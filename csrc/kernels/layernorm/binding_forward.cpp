// Registers the forward kernels as the raw op tk_cuda::layernorm (binding.h).
#include "binding.h"

namespace tk_layernorm_binding {
namespace {

// y's dtype is out_dtype, or h's: the residual's, or x's without one (fp32 with a gate).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm(const Tensor& x_in, const OptTensor& residual_in,
                                                             const OptTensor& weight_in, const OptTensor& bias_in,
                                                             const OptTensor& rng, double eps, double p, bool rms,
                                                             bool stats, std::optional<at::ScalarType> out_dtype,
                                                             const OptTensor& gate_in) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() >= 1, "tk_cuda::layernorm: x must be a CUDA tensor");
  const Tensor x = binding::dense(x_in);
  const OptTensor residual = contig(residual_in), weight = contig(weight_in), bias = contig(bias_in);
  const OptTensor gate = contig(gate_in);
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(hidden % 8 == 0 && hidden > 0 && hidden <= tk_layernorm::kMaxHidden,
              "tk_cuda::layernorm: hidden size must be a multiple of 8 in [8, 16384], got ", hidden);
  check_operand(x, x, x.numel(), "x");
  check_operand(residual, x, x.numel(), "residual");
  check_operand(weight, x, hidden, "weight");
  check_operand(bias, x, hidden, "bias");
  check_operand(gate, x, x.numel(), "gate");
  TORCH_CHECK(!(rms && present(bias)), "tk_cuda::layernorm: RMSNorm takes no bias");
  TORCH_CHECK(!present(gate) || (!present(residual) && p == 0.0),
              "tk_cuda::layernorm: a gated norm takes no residual or dropout");
  const at::ScalarType h_type = present(gate) ? at::kFloat : present(residual) ? residual->scalar_type() : x.scalar_type();
  const at::ScalarType y_type = out_dtype.value_or(h_type);
  const tk_layernorm::DTypes dtypes = present(gate) ? gated_dtypes(x.scalar_type(), weight_dtype(weight, bias), y_type)
                                                    : dtypes_of(x.scalar_type(), h_type, weight_dtype(weight, bias), y_type);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.numel() / hidden;
  const auto f32 = x.options().dtype(at::kFloat);
  const bool store_h = present(residual) || p > 0.0;

  Tensor y = at::empty(x.sizes(), x.options().dtype(y_type));
  Tensor h = store_h ? at::empty(x.sizes(), x.options().dtype(h_type)) : at::empty({0}, x.options().dtype(h_type));
  // Without stats (inference) mean and rstd are empty and never written: at hidden 1024 their 8 bytes a row,
  // written a row per block, cost ~1% of the forward (H200).
  Tensor mean = at::empty({rms || !stats ? 0 : rows}, f32);
  Tensor rstd = at::empty({stats ? rows : 0}, f32);
  const tk_layernorm::DropoutArgs dropout = dropout_args(p, rng);  // validates rng before it is read
  Tensor rng_out = p > 0.0 ? rng->clone() : at::zeros({2}, at::TensorOptions().dtype(at::kLong));

  tk_layernorm::ForwardArgs a{};
  a.y = y.data_ptr();
  a.h = store_h ? h.data_ptr() : nullptr;
  a.mean = rms || !stats ? nullptr : mean.data_ptr<float>();
  a.rstd = stats ? rstd.data_ptr<float>() : nullptr;
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
  const cudaError_t err = tk_layernorm::forward(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "tk_cuda::layernorm: launch failed: ", cudaGetErrorString(err));
  return {y, h, mean, rstd, rng_out};
}

}  // namespace
}  // namespace tk_layernorm_binding

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("layernorm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, Tensor? rng, float eps, float p, bool rms, "
        "bool stats=True, ScalarType? out_dtype=None, Tensor? gate=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) { m.impl("layernorm", &tk_layernorm_binding::layernorm); }
