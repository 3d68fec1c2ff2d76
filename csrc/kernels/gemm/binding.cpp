// Registers tk_cuda::gemm (same schema as tk::gemm in tk_inductor/ops/gemm.py) and
// tk_cuda::gemm_config (pipeline depth and epilogue choices for the ablation, benchmarks only).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "gemm.cuh"

namespace {

// TMA reads rows whose stride is a multiple of 16 bytes from a 16-byte aligned base. Any other
// operand is copied into a zero-padded buffer (extra columns are zeros, so the product is exact).
at::Tensor tma_ready(const at::Tensor& t) {
  const bool ok = t.stride(1) == 1 && (t.size(0) == 1 || t.stride(0) % 8 == 0) &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  if (ok) return t;
  const int64_t cols = (t.size(1) + 7) / 8 * 8;
  at::Tensor padded = at::zeros({t.size(0), cols}, t.options());
  padded.narrow(1, 0, t.size(1)).copy_(t);
  return padded;
}

at::Tensor gemm_run(const at::Tensor& a_in, const at::Tensor& b_in, tk_kernels::gemm_config cfg) {
  TORCH_CHECK(a_in.dim() == 2 && b_in.dim() == 2, "tk_cuda::gemm: a and b must be 2-D, got ", a_in.sizes(), " and ",
              b_in.sizes());
  TORCH_CHECK(a_in.is_cuda() && b_in.is_cuda() && a_in.device() == b_in.device(),
              "tk_cuda::gemm: a and b must be CUDA tensors on one device");
  TORCH_CHECK(a_in.scalar_type() == at::kBFloat16 && b_in.scalar_type() == at::kBFloat16,
              "tk_cuda::gemm: a and b must be bfloat16, got ", a_in.scalar_type(), " and ", b_in.scalar_type());
  TORCH_CHECK(a_in.size(1) == b_in.size(0), "tk_cuda::gemm: inner dims differ: ", a_in.sizes(), " @ ", b_in.sizes());
  TORCH_CHECK(a_in.size(0) >= 1 && a_in.size(1) >= 1 && b_in.size(1) >= 1, "tk_cuda::gemm: M, N, K must be >= 1");
  TORCH_CHECK(a_in.size(0) < (1LL << 31) && a_in.size(1) < (1LL << 31) && b_in.size(1) < (1LL << 31),
              "tk_cuda::gemm: dims must be < 2^31");
  c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = tma_ready(a_in), b = tma_ready(b_in);
  const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(1);
  // The TMA-store epilogue needs 16-byte rows: pad the output's row stride, return the M x N view.
  const int64_t ldc = cfg.tma_store ? (N + 7) / 8 * 8 : N;
  at::Tensor c = at::empty({M, ldc}, a_in.options()).narrow(1, 0, N);
  const char* err = tk_kernels::gemm_bf16(reinterpret_cast<const __nv_bfloat16*>(a.data_ptr()),
                                          reinterpret_cast<const __nv_bfloat16*>(b.data_ptr()),
                                          reinterpret_cast<__nv_bfloat16*>(c.data_ptr()), int(M), int(N), int(K), a.stride(0),
                                          b.stride(0), c.stride(0), cfg, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "tk_cuda::gemm: ", err ? err : "");
  return c;
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b) { return gemm_run(a, b, tk_kernels::gemm_config{}); }

at::Tensor gemm_config(const at::Tensor& a, const at::Tensor& b, int64_t stages, bool tma_store, bool overlap) {
  TORCH_CHECK(stages >= 1 && stages <= 4, "tk_cuda::gemm_config: stages must be 1..4");
  return gemm_run(a, b, tk_kernels::gemm_config{int(stages), tma_store, overlap});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("gemm(Tensor a, Tensor b) -> Tensor");
  m.def("gemm_config(Tensor a, Tensor b, int stages, bool tma_store, bool overlap) -> Tensor");
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("gemm", &gemm);
  m.impl("gemm_config", &gemm_config);
}
