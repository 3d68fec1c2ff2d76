// The Based kernels' shared pieces: chunk and feature constants, and what the wgmma scans (the forward, based.cu;
// the backward's dq scan, based_dq.cu) share: tile types, the φ tiles of the quadratic features, the state's bf16
// copies and the normaliser's sums. See based.cu for the scan.
#pragma once
#include <tk/tk.cuh>
#include <tk/ops/warp/mma.cuh>

#include <utility>

#include "linear_attention.h"

namespace tk_linear_attention {

// Backward kernel A (based_dq.cu): dq and 1/(d + eps), a forward scan; based_backward.cu launches it.
const char* launch_based_dq(const BasedBwdArgs& a, cudaStream_t stream);

namespace {

using namespace tk;

constexpr int CHUNK = 64, DK = BASED_DK;
static_assert(DK == BASE, "the feature maps are built per 16x16 base tile");

constexpr int DV_TILE = BASED_DV_TILE;         // value columns per block
constexpr int QUAD_TILES = DK * DK / CHUNK;    // A2 in wgmma tiles of 64 features
using RowsTile = st<bf16, CHUNK, DK>;          // a chunk of q or k
using ValueTile = st<bf16, CHUNK, DV_TILE>;    // a chunk of v, o or do; also one A2 tile (64 features x 64 columns)
using LinTile = st<bf16, DV_TILE, DK>;         // A1ᵀ
using Frag = rt_base<bf16, row_layout>;

// φq's feature tile T (64 quadratic features), this warp's 16 rows: column 16w + b holds qs_a·qs_b, a = 4T + w,
// from qs = (scale/√2)·q. Column block w scales qs's pairs by qs_a of their row.
template <int A>
__device__ __forceinline__ void quad_block_q(Frag& dst, const Frag& qs) {
  const bf16_2 r[2] = {column_at<A, 0>(qs), column_at<A, 1>(qs)};
#pragma unroll
  for (int k = 0; k < 4; ++k) dst.data[k] = __hmul2(qs.data[k], r[k & 1]);
}
template <int T, int... W>
__device__ __forceinline__ void quad_features_q(rt_bf<BASE, DV_TILE>& f, const Frag& qs, std::integer_sequence<int, W...>) {
  (quad_block_q<4 * T + W>(f.tiles[0][W], qs), ...);
}
// φk's feature tile T, transposed, this warp's 16 features (a = 4T + warp, b) by the chunk's 64 tokens: k_a·k_b, from
// kt = kᵀ (16 x 64, the col-layout k tile's registers).
template <int T>
__device__ __forceinline__ void quad_features_k(rt_bf<BASE, CHUNK>& f, const rt_bf<BASE, CHUNK>& kt) {
  constexpr int H = (4 * T) / 8;  // row a = a8 + 8H of kᵀ
  const int a8 = (4 * T) % 8 + warpid();
#pragma unroll
  for (int m = 0; m < CHUNK / BASE; ++m) {
    const bf16_2 c[2] = {row_pair_at<H, 0>(kt.tiles[0][m], a8), row_pair_at<H, 1>(kt.tiles[0][m], a8)};
#pragma unroll
    for (int k = 0; k < 4; ++k) f.tiles[0][m].data[k] = __hmul2(kt.tiles[0][m].data[k], c[k >> 1]);
  }
}


// The state's bf16 copies, the B operands of a chunk's inter-chunk products: A2's four tiles and A1ᵀ.
struct StateCopy {
  ValueTile quad[QUAD_TILES];
  LinTile lin;
};
// Each warp stores its rows of the state before the chunk (the caller fences and syncs before wgmma reads them).
__device__ __forceinline__ void publish_state(StateCopy& dst, const rt_fl<BASE, DV_TILE> (&quad)[QUAD_TILES],
                                              const rt_fl<BASE, DK>& lin) {
  rt_bf<BASE, DV_TILE> copy_bf;
#pragma unroll
  for (int t = 0; t < QUAD_TILES; ++t) {
    copy(copy_bf, quad[t]);
    warpgroup::store(dst.quad[t], copy_bf);
  }
  rt_bf<BASE, DK> lin_bf;
  copy(lin_bf, lin);
  warpgroup::store(dst.lin, lin_bf);
}

// The normaliser's sums over the previous chunks, in every warp: Z = Σ k kᵀ (fp32, symmetric) and K1 = Σ k, so that
// Σ_prev κ(q, k_j) = 64·chunks + scale·q·K1 + (scale²/2) qᵀ Z q.
struct NormSums {
  rt_fl<BASE, DK> z;
  float k1[2];  // K1_b for b = lane/4 + 8i

  __device__ __forceinline__ void clear() {
    zero(z);
    k1[0] = k1[1] = 0.f;
  }
  // This lane's share of Σ_b q_b (scale·K1_b + (scale²/2)(q Z)_b) for its rows (lane/4 and lane/4 + 8) into den; zq
  // gets q Z and k1c K1 at the lane's columns 2(lane%4) + j + 8m, [m][j]. q Z from Z's two bf16 halves: Z is
  // symmetric, so its row-layout registers are also its col-layout ones (a B operand).
  __device__ __forceinline__ void inter(float (&den)[2], rt_fl<BASE, DK>& zq, float (&k1c)[2][2],
                                        const rt_bf<BASE, DK>& qr, float scale) const {
    rt_bf<BASE, DK> zhi, zlo;
    copy(zhi, z);
    map_indexed(zlo, z, zhi, [](int, int, float x, float hi) { return x - hi; });
    zero(zq);
    mma_AB(zq, qr, reinterpret_cast<const rt_bf<BASE, DK, col_layout>&>(zhi), zq);
    mma_AB(zq, qr, reinterpret_cast<const rt_bf<BASE, DK, col_layout>&>(zlo), zq);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int j = 0; j < 2; ++j) k1c[m][j] = __shfl_sync(0xffffffffu, k1[m], 8 * (laneid() & 3) + 4 * j);
    const float half_sq = 0.5f * scale * scale;
    map_indexed(zq, zq, qr, [&](int r, int col, float y, float q) {
      den[r >> 3] += q * (scale * k1c[(col >> 3) & 1][col & 1] + half_sq * y);
      return y;
    });
  }
  // The chunk's keys join the sums: Z += kᵀ k, K1 += Σ k (kc holds k(j, b) with b = lane/4 + 8(register % 2)).
  __device__ __forceinline__ void add(const rt_bf<CHUNK, DK, col_layout>& kc) {
    mma_AB(z, transposed(kc), kc, z);
    float ks[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < CHUNK / BASE; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 pair = __bfloat1622float2(kc.tiles[i][0].data[k]);
        ks[k & 1] += pair.x + pair.y;
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      ks[i] += __shfl_xor_sync(0xffffffffu, ks[i], 1);
      ks[i] += __shfl_xor_sync(0xffffffffu, ks[i], 2);
      k1[i] += ks[i];
    }
  }
};

}  // namespace
}  // namespace tk_linear_attention
