// Based linear attention, backward (linear_attention.h): delta = do·o per row (normalising only), then the two
// chunked scans on wgmma as one grid of two roles: kernel B (based_dkdv.cuh: dk and dv, chunks last to first) and
// kernel A (based_dq.cuh: dq, first to last), each one warpgroup per (batch·head, 64 value columns), two blocks per
// SM. Neither needs the other's results, so a grid that leaves SMs idle for one scan runs both side by side.
// README "Backward: the equations" has the math.
#include "based_dkdv.cuh"
#include "based_dq.cuh"

namespace tk_linear_attention {
namespace {

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
  if (const char* e = make_input_maps<DK>(g, a)) return e;
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
  if (a.dv <= 0 || a.dv % VALUE_TILE != 0) return "dv must be a positive multiple of 64";
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  if (a.normalize)
    if (const char* e = launch_delta(a, stream)) return e;
  return a.normalize ? launch_scans<true>(a, stream) : launch_scans<false>(a, stream);
}

}  // namespace tk_linear_attention
