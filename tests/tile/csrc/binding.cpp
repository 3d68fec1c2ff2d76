// Registers the tile-library unit-test kernels as tk_tile_tests::* ops (tests only).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "tile_tests.cuh"

namespace {

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void ok(const char* err) { TORCH_CHECK(err == nullptr, "tk_tile_tests: ", err ? err : ""); }

std::tuple<at::Tensor, at::Tensor> tile_op(const at::Tensor& x, const at::Tensor& y, int64_t op, int64_t reg, bool col) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && y.sizes() == x.sizes() &&
                  y.is_contiguous() && y.scalar_type() == at::kFloat,
              "tile_op: x, y contiguous fp32 CUDA matrices of one shape");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  // One guard region past the end catches out-of-bounds writes.
  at::Tensor out = at::full({rows * cols + 64}, 12345.f, x.options());
  at::Tensor vout = at::full({std::max(rows, cols) + 64}, 12345.f, x.options());
  ok(tk_tests::tile_op(x.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), vout.data_ptr<float>(), int(rows),
                       int(cols), int(op), int(reg), col, stream()));
  return {out, vout};
}

at::Tensor wgmma_op(const at::Tensor& a, const at::Tensor& b, const at::Tensor& d, int64_t variant, bool accumulate) {
  TORCH_CHECK(a.is_cuda() && a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf),
              "wgmma_op: contiguous bf16/fp16 a, b");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 2 && d.size(0) == 64, "wgmma_op: d is 64 x n fp32");
  c10::cuda::CUDAGuard guard(a.device());
  const bool at_ = variant == 2 || variant == 3, bt = variant == 1 || variant == 3 || variant == 5;
  const int64_t k = at_ ? a.size(0) : a.size(1), n = bt ? b.size(0) : b.size(1);
  at::Tensor out = d.clone();
  ok(tk_tests::wgmma_op(a.data_ptr(), b.data_ptr(), out.data_ptr<float>(), int(n), int(k), int(variant),
                        a.scalar_type() == at::kHalf, accumulate, stream()));
  return out;
}

at::Tensor warp_mma_op(const at::Tensor& a, const at::Tensor& b, const at::Tensor& d, int64_t variant) {
  TORCH_CHECK(a.is_cuda() && a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf) && a.size(0) == 32 && a.size(1) == 32,
              "warp_mma_op: contiguous 32 x 32 bf16/fp16 a, b of the same type");
  TORCH_CHECK(b.numel() == 32 * 48 && d.scalar_type() == at::kFloat && d.numel() == 32 * 48, "warp_mma_op: b 32x48 / 48x32, d 32 x 48 fp32");
  c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = d.contiguous().clone();
  ok(tk_tests::warp_mma_op(a.data_ptr(), b.data_ptr(), out.data_ptr<float>(), int(variant), a.scalar_type() == at::kHalf,
                           stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> tma_roundtrip(const at::Tensor& x, int64_t tile) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.is_contiguous(), "tma_roundtrip: contiguous 4-D CUDA tensor");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor o1 = at::full_like(x, -3.f), o2 = at::full_like(x, -3.f);
  ok(tk_tests::tma_roundtrip(x.data_ptr(), o1.data_ptr(), o2.data_ptr(), int(x.size(0)), int(x.size(1)), int(x.size(2)),
                             int(x.size(3)), int(tile), stream()));
  return {o1, o2};
}

at::Tensor smem_load_loop(bool swizzled, int64_t iters) {
  at::Tensor out = at::empty({64, 64}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  ok(tk_tests::smem_load_loop(out.data_ptr<float>(), swizzled, int(iters), stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY(tk_tile_tests, m) {
  m.def("tile_op(Tensor x, Tensor y, int op, int reg, bool col) -> (Tensor, Tensor)");
  m.def("wgmma_op(Tensor a, Tensor b, Tensor d, int variant, bool accumulate) -> Tensor");
  m.def("warp_mma_op(Tensor a, Tensor b, Tensor d, int variant) -> Tensor");
  m.def("tma_roundtrip(Tensor x, int tile) -> (Tensor, Tensor)");
  m.def("smem_load_loop(bool swizzled, int iters) -> Tensor");
}

TORCH_LIBRARY_IMPL(tk_tile_tests, CUDA, m) {
  m.impl("tile_op", &tile_op);
  m.impl("wgmma_op", &wgmma_op);
  m.impl("warp_mma_op", &warp_mma_op);
  m.impl("tma_roundtrip", &tma_roundtrip);
}

TORCH_LIBRARY_IMPL(tk_tile_tests, CompositeExplicitAutograd, m) { m.impl("smem_load_loop", &smem_load_loop); }
