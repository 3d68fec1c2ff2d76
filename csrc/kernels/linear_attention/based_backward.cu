// Based linear attention, backward (linear_attention.h): delta = do·o per row (normalising only), then the two
// chunked scans on wgmma as one grid of two roles: kernel B (based_dkdv.cuh: dk and dv, chunks last to first) and
// kernel A (based_dq.cuh: dq, first to last), each one warpgroup per (batch·head, 64 value columns), two blocks per
// SM. Neither needs the other's results, so a grid that leaves SMs idle for one scan runs both side by side.
// README "Backward: the equations" has the math.
#include "based_dkdv.cuh"
#include "based_dq.cuh"

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

// Blocks [0, blocks) run kernel B, the longer one (dispatched first), the rest kernel A.
template <bool NORM>
__global__ void __launch_bounds__(WARPGROUP_THREADS, 2) based_bwd_kernel(const __grid_constant__ BwdGlobals g) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem = align_shared<1024>(raw);
  if (int(blockIdx.x) < g.blocks) dkdv_scan<NORM>(g, smem, int(blockIdx.x));
  else dq_scan<NORM>(g, smem, int(blockIdx.x) - g.blocks);
}

template <bool NORM>
const char* launch_scans(const BasedBwdArgs& a, cudaStream_t stream) {
  BwdGlobals g{};
  if (const char* e = make_input_maps(g, a)) return e;
  if (const char* e = make_tma_map(g.dout, gl<bf16>(static_cast<bf16*>(const_cast<void*>(a.dout)), a.B, a.H, a.N, a.dv)))
    return e;
  g.k_rows = static_cast<const bf16*>(a.k);
  for (int d = 0; d < 3; ++d) g.k_stride[d] = a.k_stride[d];
  g.delta = a.delta, g.dq = a.dq, g.dk = a.dk, g.dv = static_cast<bf16*>(a.dv_out);
  g.H = a.H, g.N = a.N, g.dv_cols = a.dv, g.tiles_v = a.dv / DV_TILE, g.scale = a.scale, g.eps = a.eps;
  const int64_t blocks = int64_t(a.B) * a.H * g.tiles_v;
  g.blocks = int(blocks);  // (launch_warpgroups refuses a grid past 2^31 - 1 before it runs)
  const size_t smem = (sizeof(DkdvSmem) > sizeof(DqSmem) ? sizeof(DkdvSmem) : sizeof(DqSmem)) + 1024;  // + alignment
  return launch_warpgroups(based_bwd_kernel<NORM>, 2 * blocks, smem, g, stream);
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
  return a.normalize ? launch_scans<true>(a, stream) : launch_scans<false>(a, stream);
}

}  // namespace tk_linear_attention
