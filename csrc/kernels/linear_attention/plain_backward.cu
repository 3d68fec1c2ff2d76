// Plain linear attention (identity, elu + 1), backward (linear_attention.h): normalising, delta = do·o per row and
// each chunk's Σ φk; then the two chunked scans as one grid of two roles, kernel B (plain_dkdv.cuh: dk and dv, last
// chunk to first) and kernel A (plain_dq.cuh: dq, first to last), each one warpgroup per (batch·head, 64 value
// columns). Neither needs the other's results, so a grid that leaves SMs idle for one scan runs both side by side.
#include "plain_dkdv.cuh"

namespace tk_linear_attention {
namespace {

// Σ φk over each chunk's rows below N, into ksum (B·H, chunks, F): one block per (batch·head, chunk), thread t taking
// column pair t % (F/2) over every (128 / (F/2))-th row.
template <int F, FeatureMap M>
__global__ void __launch_bounds__(WARPGROUP_THREADS) plain_key_sums_kernel(const PlainBwdArgs a, float* ksum) {
  constexpr int pairs = F / 2, groups = WARPGROUP_THREADS / pairs;
  __shared__ float2 part[groups][pairs];
  const int chunks = (a.N + CHUNK - 1) / CHUNK;
  const int bh = blockIdx.x / chunks, c = blockIdx.x % chunks, b = bh / a.H, h = bh % a.H;
  const int pair = threadIdx.x % pairs, group = threadIdx.x / pairs;
  const bf16* k = static_cast<const bf16*>(a.k) + b * a.k_stride[0] + h * a.k_stride[1];
  float2 sum = make_float2(0.f, 0.f);
  for (int r = c * CHUNK + group; r < min(a.N, (c + 1) * CHUNK); r += groups) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(k + r * a.k_stride[2] + 2 * pair));
    sum.x += phi<M>(x.x), sum.y += phi<M>(x.y);
  }
  part[group][pair] = sum;
  __syncthreads();
  if (group == 0) {
    for (int i = 1; i < groups; ++i) sum.x += part[i][pair].x, sum.y += part[i][pair].y;
    *reinterpret_cast<float2*>(ksum + (int64_t(bh) * chunks + c) * F + 2 * pair) = sum;
  }
}

// Blocks [0, blocks) run kernel B (the longer one, dispatched first), the rest kernel A.
template <int F, FeatureMap M, bool NORM>
__global__ void __launch_bounds__(WARPGROUP_THREADS, 2) plain_bwd_kernel(const __grid_constant__ BwdGlobals<F> g) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem = align_shared<1024>(raw);
  if (int(blockIdx.x) < g.blocks) dkdv_scan<F, M, NORM>(g, smem, int(blockIdx.x));
  else dq_scan<F, M, NORM>(g, smem, int(blockIdx.x) - g.blocks);
}

template <int F, FeatureMap M, bool NORM>
const char* launch_scans(const PlainBwdArgs& a, cudaStream_t stream) {
  BwdGlobals<F> g{};
  if (const char* e = make_input_maps<F>(g, a)) return e;
  if (const char* e = make_tma_map(g.dout, gl<bf16>(static_cast<bf16*>(const_cast<void*>(a.dout)), a.B, a.H, a.N, a.dv)))
    return e;
  g.delta = a.delta, g.ksum = a.ksum, g.dq = a.dq, g.dk = a.dk, g.dv = static_cast<bf16*>(a.dv_out);
  g.dq_out = static_cast<bf16*>(a.dq_out), g.dk_out = static_cast<bf16*>(a.dk_out);
  g.H = a.H, g.N = a.N, g.dv_cols = a.dv, g.tiles_v = a.dv / DV_TILE, g.scale = a.scale, g.eps = a.eps;
  const int64_t blocks = int64_t(a.B) * a.H * g.tiles_v;
  if (blocks > 0x7fffffff) return "too many (batch, head, value tile) blocks for one launch";
  const size_t smem = std::max(sizeof(DkdvSmem<F>), sizeof(DqSmem<F>)) + 1024;  // + alignment
  if constexpr (NORM) {
    const int64_t sum_blocks = int64_t(a.B) * a.H * ((a.N + CHUNK - 1) / CHUNK);
    if (sum_blocks > 0x7fffffff) return "too many chunks for the key-sums launch";
    plain_key_sums_kernel<F, M><<<unsigned(sum_blocks), WARPGROUP_THREADS, 0, stream>>>(a, a.ksum);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  }
  g.blocks = int(blocks);
  return launch_warpgroups(plain_bwd_kernel<F, M, NORM>, 2 * blocks, smem, g, stream);
}

}  // namespace

const char* launch_plain_backward(const PlainBwdArgs& a, cudaStream_t stream) {
  if (a.dv <= 0 || a.dv % DV_TILE != 0) return "dv must be a positive multiple of 64";
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  if ((a.dv == DV_TILE) != (a.dq_out != nullptr && a.dk_out != nullptr))
    return "bf16 dq_out and dk_out with one value tile (dv 64), fp32 dq and dk with several";
  if (a.normalize)
    if (const char* e = launch_delta(a, stream)) return e;
  return dispatch_plain(a.features, a.map, [&]<int F, FeatureMap M>() {
    return a.normalize ? launch_scans<F, M, true>(a, stream) : launch_scans<F, M, false>(a, stream);
  });
}

}  // namespace tk_linear_attention
