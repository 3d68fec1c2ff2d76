// What the plain feature-map scans share: the forward (plain_forward.cuh; identity and elu + 1 built in plain.cu,
// Hedgehog in hedgehog.cu) and the backward's two scans (plain_dq.cuh, plain_dkdv.cuh, launched by plain_backward.cu).
//
// κ(q, k) = scale·φ(q)·φ(k). The elementwise maps' features are q's and k's own dk columns (64 or 128); Hedgehog's
// are the two softmaxes of F/2 projections of them (F 64 or 128). Each block is one warpgroup on one (batch·head, 64
// value columns) that walks the sequence in chunks of 64 tokens. A chunk's q and k land by TMA; elu + 1 maps them in
// place in shared memory (identity reads them as they are) and Hedgehog computes its features from them into tiles
// of their own, so every product reads its operands from shared memory: the chunk's masked scores φQ φKᵀ, the
// intra-chunk product with v, the inter-chunk product with the state's bf16 copy, and the state's update φKᵀ v. The
// state (F features x 64 value columns, fp32) is F/64 wgmma accumulators of 64 x 64. The scale is applied in fp32
// at the end (φq and φk stay unscaled, so φ'(x) = min(φ(x), 1) for elu + 1 comes from the mapped tile).
#pragma once
#include <tk/tk.cuh>

#include "common.cuh"

namespace tk_linear_attention {

namespace {

using namespace tk;

constexpr int CHUNK = 64, DV_TILE = VALUE_TILE;
template <int F> using FeatTile = st<bf16, CHUNK, F>;    // a chunk of φq or φk: F/64 column blocks of 64 features
using Block = st<bf16, CHUNK, 64>;                       // a chunk of v, o, do or dn; one column block of a FeatTile
template <int F> using StateTile = st<bf16, F, DV_TILE>;  // a state's bf16 copy: F features x 64 value columns
template <int F> using State = rt_fl<BASE, DV_TILE>[F / 64];  // the state: tile t, warp w's rows = features 64t + 16w..

template <FeatureMap M> __device__ __forceinline__ float phi(float x) {
  if constexpr (M == FeatureMap::elu1) return x > 0.f ? x + 1.f : __expf(x);
  else return x;
}
// φ'(x) from y = φ(x): elu + 1 has φ' = 1 above zero and exp(x) = φ(x) at or below it, so φ' = min(y, 1).
template <FeatureMap M> __device__ __forceinline__ float dphi(float y) {
  if constexpr (M == FeatureMap::elu1) return fminf(y, 1.f);
  else return 1.f;
}

// Column block t of a chunk tile (the blocks are consecutive 64 x 64 tiles).
template <int F> __device__ __forceinline__ const Block& column_block(const FeatTile<F>& x, int t) {
  return reinterpret_cast<const Block*>(&x)[t];
}

// Where a scan's block works: (batch·head, value tile) from its block index (blockIdx.x, or a role's int index in a
// grid of two), and the chunks of its sequence.
struct ScanBlock {
  int bh, vt, b, h, chunks;
  int64_t rows;  // bh·N: the first of the head's rows in (B·H, N, ·) outputs
  template <class G, class I> __device__ __forceinline__ ScanBlock(const G& g, I block)
      : bh(block / g.tiles_v), vt(block % g.tiles_v), b(bh / g.H), h(bh % g.H), chunks((g.N + CHUNK - 1) / CHUNK),
        rows(int64_t(bh) * g.N) {}
};

// φ over a chunk's q and k tiles in place (the caller fences and syncs before they are read).
template <FeatureMap M, int F> __device__ __forceinline__ void map_features(FeatTile<F>& q, FeatTile<F>& k) {
  if constexpr (M != FeatureMap::identity) {
    warpgroup::map(q, phi<M>);
    warpgroup::map(k, phi<M>);
  }
}

// Hedgehog: φ(x) = cat(softmax(x W), softmax(-x W)) over F/2 projections of the dk columns x, W's transpose in shared
// memory (F/2 x dk: the B operand of x W read K-major, and of dz Wᵀ read MN-major).
template <int F, int D> using ProjectionTile = st<bf16, F / 2, D>;
template <int F> using Projected = rt_fl<BASE, F / 2>;  // a warp's 16 rows of x W, or of either softmax
// p = softmax(z), n = softmax(-z) of each of this warp's rows, z = x W of the chunk (the warpgroup's product).
template <int F, int D>
__device__ __forceinline__ void hedgehog_softmaxes(Projected<F>& p, Projected<F>& n, const st<bf16, CHUNK, D>& x,
                                                   const ProjectionTile<F, D>& wt) {
  Projected<F> z;
  warpgroup::mm_ABt(z, x, wt);
  warpgroup::mma_async_wait<0>(z);
  row_vec<Projected<F>, float> bound, sum;
  row_max(bound, z);  // softmax(z) = exp(z - max z) / Σ
  sub_row(p, z, bound);
  exp(p, p);
  row_sum(sum, p);
  div_row(p, p, sum);
  row_min(bound, z);  // softmax(-z) = exp(min z - z) / Σ
  sub_row(n, z, bound);
  neg(n, n);
  exp(n, n);
  row_sum(sum, n);
  div_row(n, n, sum);
}
// The chunk's φ rows from x, stored as the feature tile's two halves (the caller fences and syncs before they are
// read).
template <int F, int D>
__device__ __forceinline__ void hedgehog_features(FeatTile<F>& dst, const st<bf16, CHUNK, D>& x,
                                                  const ProjectionTile<F, D>& wt) {
  Projected<F> p, n;
  hedgehog_softmaxes<F>(p, n, x, wt);
  rt_bf<BASE, F / 2> half;
  copy(half, p);
  warpgroup::store(dst, half, 0);
  copy(half, n);
  warpgroup::store(dst, half, F / 2);
}

template <int F> __device__ __forceinline__ void zero_state(State<F>& s) {
#pragma unroll
  for (int t = 0; t < F / 64; ++t) zero(s[t]);
}
// A scan's start: the chunk semaphores and the first chunk's load (the leader), column(i) for the F columns of the
// shared-memory vectors (the threads take them in turn) and the state zeroed, then the block's first barrier.
template <int F, class S, class Load, class Column>
__device__ __forceinline__ void start_scan(S& s, State<F>& state, Load&& load_first, Column&& column) {
  if (threadIdx.x == 0) {
    init_semaphore(s.arrived[0], 1);
    init_semaphore(s.arrived[1], 1);
    fence_semaphore_init();
    load_first();
  }
  for (int i = threadIdx.x; i < F; i += WARPGROUP_THREADS) column(i);
  zero_state<F>(state);
  __syncthreads();
}
// Each warp stores its rows of the state's bf16 copy (the caller fences and syncs before wgmma reads it).
template <int F> __device__ __forceinline__ void publish_state(StateTile<F>& dst, const State<F>& s) {
  rt_bf<BASE, DV_TILE> t;
#pragma unroll
  for (int i = 0; i < F / 64; ++i) {
    copy(t, s[i]);
    store(dst, t, 64 * i + BASE * warpid(), 0);
  }
}
// state += xᵀ y over the chunk's tokens (x: a FeatTile, y: a Block), one wgmma group per 64 features.
template <int F> __device__ __forceinline__ void update_state(State<F>& s, const FeatTile<F>& x, const Block& y) {
#pragma unroll
  for (int t = 0; t < F / 64; ++t) warpgroup::mma_AtB(s[t], column_block(x, t), y);
}
template <int F> __device__ __forceinline__ void hold_state(State<F>& s) {
#pragma unroll
  for (int t = 0; t < F / 64; ++t) warpgroup::hold(s[t]);
}

// dst[f] += sign Σ_r w_r x(r, f) over the chunk's rows (w: nullptr = 1). Thread t sums column t % F over its share of
// the rows; F < 128 shares a column between threads, which add atomically.
template <int F>
__device__ __forceinline__ void add_column_sums(float* dst, const FeatTile<F>& x, const float* w = nullptr,
                                                float sign = 1.f) {
  constexpr int share = WARPGROUP_THREADS / F, rows = CHUNK / share;
  const int col = threadIdx.x % F, r0 = (threadIdx.x / F) * rows;
  float sum = 0.f;
#pragma unroll 8
  for (int r = r0; r < r0 + rows; ++r) {
    const float v = __bfloat162float(x(r, col));
    sum += w ? w[r] * v : v;
  }
  if constexpr (share == 1) dst[col] += sign * sum;
  else atomicAdd(dst + col, sign * sum);
}

// Σ_f x[r, f] z[f] for this lane's two rows (lane/4 and lane/4 + 8 of the warp's 16), over the lane's columns: the
// quad's four lanes hold a row's columns between them (add quad_sum).
template <int F> __device__ __forceinline__ void dot_rows(float (&dst)[2], const rt_bf<BASE, F>& x, const float* z) {
#pragma unroll
  for (int m = 0; m < F / BASE; ++m)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 v = __bfloat1622float2(x.tiles[0][m].data[k]);
      const float2 w = *reinterpret_cast<const float2*>(z + BASE * m + base_col<row_layout>(k, 0));
      dst[k & 1] += v.x * w.x + v.y * w.y;
    }
}

// d[r, f] = scale φ'(x[r, f]) (acc[r, f] + zr[r] z[f]) (zr[r]·z: the rank-one dd term, or none with z = nullptr) for
// this warp's 16 rows at n0 (rows past n are dropped): stored in bf16 to `out` where the head has one value tile,
// else added by fp32 atomics to `sum` (each value tile adds its share).
template <FeatureMap M, int F>
__device__ __forceinline__ void write_grad_rows(bf16* out, float* sum, int n0, int n, const rt_fl<BASE, F>& acc,
                                                const rt_bf<BASE, F>& x, float scale, const float (&zr)[2],
                                                const float* z) {
  const int lane = laneid();
#pragma unroll
  for (int m = 0; m < F / BASE; ++m)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = n0 + (lane >> 2) + 8 * (k & 1), col = BASE * m + base_col<row_layout>(k, 0);
      if (r >= n) continue;
      float2 a = acc.tiles[0][m].data[k];
      if (z != nullptr) {
        const float2 w = *reinterpret_cast<const float2*>(z + col);
        a.x += zr[k & 1] * w.x, a.y += zr[k & 1] * w.y;
      }
      const float2 y = __bfloat1622float2(x.tiles[0][m].data[k]);
      const float2 d = make_float2(scale * dphi<M>(y.x) * a.x, scale * dphi<M>(y.y) * a.y);
      if (out != nullptr) *reinterpret_cast<bf16_2*>(out + int64_t(r) * F + col) = __float22bfloat162_rn(d);
      else atomicAdd(reinterpret_cast<float2*>(sum + int64_t(r) * F + col), d);
    }
}

// Calls f.template operator()<F, M>() for the launch's feature dim and map.
template <class Fn> const char* dispatch_plain(int dk, FeatureMap map, Fn&& f) {
  const bool elu = map == FeatureMap::elu1;
  if (map != FeatureMap::identity && !elu) return "unknown feature map";
  if (dk == 64) return elu ? f.template operator()<64, FeatureMap::elu1>() : f.template operator()<64, FeatureMap::identity>();
  if (dk == 128) return elu ? f.template operator()<128, FeatureMap::elu1>() : f.template operator()<128, FeatureMap::identity>();
  return "dk must be 64 or 128";
}

// Calls f.template operator()<F, D>() for Hedgehog's features F and q/k columns D.
template <class Fn> const char* dispatch_hedgehog(int dk, int features, Fn&& f) {
  if (dk == 64) {
    if (features == 64) return f.template operator()<64, 64>();
    if (features == 128) return f.template operator()<128, 64>();
  } else if (dk == 128) {
    if (features == 64) return f.template operator()<64, 128>();
    if (features == 128) return f.template operator()<128, 128>();
  }
  return "Hedgehog takes dk 64 or 128 and 64 or 128 features";
}

}  // namespace
}  // namespace tk_linear_attention
