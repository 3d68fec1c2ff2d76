// Plain linear attention (identity, elu + 1), backward (linear_attention.h): delta = do·o per row (normalising
// only), then the two chunked scans, kernel A (plain_dq.cuh: dq, first chunk to last) and kernel B (plain_dkdv.cuh:
// dk and dv, last to first), each one warpgroup per (batch·head, 64 value columns). Without normalising they need
// nothing from each other and run as one grid of two roles; normalising, kernel A hands each row's 1/(d + eps) to
// kernel B, which runs after it.
#include "plain_dkdv.cuh"

namespace tk_linear_attention {
namespace {

// Blocks [0, blocks_b) run kernel B (the longer one, dispatched first), the rest kernel A.
template <int F, FeatureMap M, bool NORM>
__global__ void __launch_bounds__(WARPGROUP_THREADS, 2) plain_bwd_kernel(const __grid_constant__ BwdGlobals<F> g) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem = align_shared<1024>(raw);
  if (int(blockIdx.x) < g.blocks_b) dkdv_scan<F, M, NORM>(g, smem, int(blockIdx.x));
  else dq_scan<F, M, NORM>(g, smem, int(blockIdx.x) - g.blocks_b);
}

template <int F, FeatureMap M, bool NORM>
const char* launch_scans(const PlainBwdArgs& a, cudaStream_t stream) {
  BwdGlobals<F> g{};
  if (const char* e = make_plain_maps<F>(g, a)) return e;
  if (const char* e = make_tma_map(g.dout, gl<bf16>(static_cast<bf16*>(const_cast<void*>(a.dout)), a.B, a.H, a.N, a.dv)))
    return e;
  g.delta = a.delta, g.inv = a.inv, g.dq = a.dq, g.dk = a.dk, g.dv = static_cast<bf16*>(a.dv_out);
  g.H = a.H, g.N = a.N, g.dv_cols = a.dv, g.tiles_v = a.dv / DV_TILE, g.scale = a.scale, g.eps = a.eps;
  const int64_t blocks = int64_t(a.B) * a.H * g.tiles_v;
  if (blocks > 0x7fffffff) return "too many (batch, head, value tile) blocks for one launch";
  const size_t smem = std::max(sizeof(DkdvSmem<F>), sizeof(DqSmem<F>)) + 1024;  // + alignment
  const auto kernel = plain_bwd_kernel<F, M, NORM>;
  if constexpr (!NORM) {
    g.blocks_b = int(blocks);
    return launch_warpgroups(kernel, 2 * blocks, smem, g, stream);
  }
  g.blocks_b = 0;  // kernel A alone, then kernel B alone
  if (const char* e = launch_warpgroups(kernel, blocks, smem, g, stream)) return e;
  g.blocks_b = int(blocks);
  return launch_warpgroups(kernel, blocks, smem, g, stream);
}

}  // namespace

const char* launch_plain_backward(const PlainBwdArgs& a, cudaStream_t stream) {
  if (a.dv <= 0 || a.dv % DV_TILE != 0) return "dv must be a positive multiple of 64";
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  if (a.normalize)
    if (const char* e = launch_delta(a, stream)) return e;
  return dispatch_plain(a.features, a.map, [&]<int F, FeatureMap M>() {
    return a.normalize ? launch_scans<F, M, true>(a, stream) : launch_scans<F, M, false>(a, stream);
  });
}

}  // namespace tk_linear_attention
