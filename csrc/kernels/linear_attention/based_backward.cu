// Based linear attention, backward (linear_attention.h): delta = do·o per row (normalising only), then the two
// chunked scans on wgmma: kernel A (based_dq.cu) gives dq and each row's 1/(d + eps), kernel B (based_dkdv.cu) dk and
// dv. README "Backward: the equations" has the math.
#include "based.cuh"

namespace tk_linear_attention {
namespace {

// delta = do·o per row of (B·H·N, dv) contiguous bf16 rows: one warp a row (one kernel instead of ATen's four passes
// through fp32 copies).
__global__ void __launch_bounds__(256) based_bwd_delta_kernel(const BasedBwdArgs a, int64_t rows) {
  const int64_t row = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;
  const bf16_2* dout = static_cast<const bf16_2*>(a.dout) + row * (a.dv / 2);
  const bf16_2* o = static_cast<const bf16_2*>(a.o) + row * (a.dv / 2);
  float sum = 0.f;
  for (int i = laneid(); i < a.dv / 2; i += 32) {
    const float2 d = __bfloat1622float2(dout[i]), y = __bfloat1622float2(o[i]);
    sum += d.x * y.x + d.y * y.y;
  }
  sum = warp_sum(sum);
  if (laneid() == 0) a.delta[row] = sum;
}

}  // namespace

const char* launch_based_backward(const BasedBwdArgs& a, cudaStream_t stream) {
  if (a.dv <= 0 || a.dv % BASED_DV_TILE != 0) return "dv must be a positive multiple of 64";
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  if (a.normalize) {
    const int64_t rows = int64_t(a.B) * a.H * a.N, delta_blocks = (rows + 7) / 8;
    if (delta_blocks > 0x7fffffff) return "too many rows for the delta launch";
    based_bwd_delta_kernel<<<unsigned(delta_blocks), 256, 0, stream>>>(a, rows);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  }
  // dq first: it also writes 1/(d + eps), which the reverse scan reads
  if (const char* err = launch_based_dq(a, stream)) return err;
  return launch_based_dkdv(a, stream);
}

}  // namespace tk_linear_attention
