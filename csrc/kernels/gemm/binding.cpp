// Registers tk_cuda::gemm (same schema as tk::gemm in tk_inductor/ops/gemm.py) and
// tk_cuda::gemm_config (pipeline depth and epilogue choices for the ablation, benchmarks only).
#include "binding/stable.h"

#include "gemm.cuh"

namespace {

using binding::dtype_name;
using binding::ScalarType;
using binding::shape_str;
using binding::Tensor;

// TMA reads rows whose stride is a multiple of 16 bytes from a 16-byte aligned base. Any other
// operand is copied into a zero-padded buffer (extra columns are zeros, so the product is exact).
Tensor tma_ready(const Tensor& t) {
  const bool ok = t.stride(1) == 1 && (t.size(0) == 1 || t.stride(0) % 8 == 0) &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  if (ok) return t;
  const int64_t cols = (t.size(1) + 7) / 8 * 8;
  Tensor padded = torch::stable::new_zeros(t, binding::Sizes{t.size(0), cols});
  Tensor inner = torch::stable::narrow(padded, 1, 0, t.size(1));
  torch::stable::copy_(inner, t);
  return padded;
}

Tensor gemm_run(const Tensor& a_in, const Tensor& b_in, tk_kernels::gemm_config cfg) {
  STD_TORCH_CHECK(a_in.dim() == 2 && b_in.dim() == 2, "tk_cuda::gemm: a and b must be 2-D, got ", shape_str(a_in),
                  " and ", shape_str(b_in));
  STD_TORCH_CHECK(a_in.is_cuda() && b_in.is_cuda() && binding::same_device(a_in, b_in),
                  "tk_cuda::gemm: a and b must be CUDA tensors on one device");
  STD_TORCH_CHECK(a_in.scalar_type() == ScalarType::BFloat16 && b_in.scalar_type() == ScalarType::BFloat16,
                  "tk_cuda::gemm: a and b must be bfloat16, got ", dtype_name(a_in.scalar_type()), " and ",
                  dtype_name(b_in.scalar_type()));
  STD_TORCH_CHECK(a_in.size(1) == b_in.size(0), "tk_cuda::gemm: inner dims differ: ", shape_str(a_in), " @ ",
                  shape_str(b_in));
  STD_TORCH_CHECK(a_in.size(0) >= 1 && a_in.size(1) >= 1 && b_in.size(1) >= 1, "tk_cuda::gemm: M, N, K must be >= 1");
  STD_TORCH_CHECK(a_in.size(0) < (1LL << 31) && a_in.size(1) < (1LL << 31) && b_in.size(1) < (1LL << 31),
              "tk_cuda::gemm: dims must be < 2^31");
  const binding::DeviceGuard guard(a_in.get_device_index());
  const Tensor a = tma_ready(a_in), b = tma_ready(b_in);
  const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(1);
  // The TMA-store epilogue needs 16-byte rows: pad the output's row stride, return the M x N view.
  const int64_t ldc = cfg.tma_store ? (N + 7) / 8 * 8 : N;
  Tensor c_rows = torch::stable::new_empty(a_in, binding::Sizes{M, ldc});
  Tensor c = torch::stable::narrow(c_rows, 1, 0, N);
  const char* err = tk_kernels::gemm_bf16(reinterpret_cast<const __nv_bfloat16*>(a.data_ptr()),
                                          reinterpret_cast<const __nv_bfloat16*>(b.data_ptr()),
                                          reinterpret_cast<__nv_bfloat16*>(c.data_ptr()), int(M), int(N), int(K), a.stride(0),
                                          b.stride(0), c.stride(0), cfg, binding::current_stream(a_in));
  STD_TORCH_CHECK(err == nullptr, "tk_cuda::gemm: ", err ? err : "");
  return c;
}

Tensor gemm(const Tensor& a, const Tensor& b) { return gemm_run(a, b, tk_kernels::gemm_config{}); }

Tensor gemm_config(const Tensor& a, const Tensor& b, int64_t stages, bool tma_store, bool overlap) {
  STD_TORCH_CHECK(stages >= 1 && stages <= 4, "tk_cuda::gemm_config: stages must be 1..4");
  return gemm_run(a, b, tk_kernels::gemm_config{int(stages), tma_store, overlap});
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("gemm(Tensor a, Tensor b) -> Tensor");
  m.def("gemm_config(Tensor a, Tensor b, int stages, bool tma_store, bool overlap) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("gemm", TORCH_BOX(&gemm));
  m.impl("gemm_config", TORCH_BOX(&gemm_config));
}
