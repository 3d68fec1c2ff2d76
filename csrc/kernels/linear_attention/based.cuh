// What the Based kernels' chunked scans (the forward, based.cu; the backward's based_dq.cuh and based_dkdv.cuh) share:
// constants, tile types, the φ tiles of the quadratic features, the state's bf16 copies, sums of x xᵀ, the
// normaliser's share of the previous chunks and the backward's Jacobian contraction. See based.cu for the scan.
#pragma once
#include <tk/tk.cuh>
#include <tk/ops/warp/mma.cuh>

#include <utility>

#include "common.cuh"

namespace tk_linear_attention {

namespace {

using namespace tk;

constexpr int CHUNK = 64, DK = BASED_DK;
static_assert(DK == BASE, "the feature maps are built per 16x16 base tile");

constexpr int DV_TILE = VALUE_TILE;         // value columns per block
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

// Sums of x xᵀ and x over chunks of 16-wide rows, in every warp: the normaliser's Z = Σ k kᵀ and K1 = Σ k (so that
// Σ_prev κ(q, k_j) = 64·chunks + scale·q·K1 + (scale²/2) qᵀ Z q), or kernel B's dd-weighted Σ dd q qᵀ and Σ dd q.
struct RowSums {
  rt_fl<BASE, DK> z;  // symmetric
  float k1[2];        // the vector sum at b = lane/4 + 8i

  __device__ __forceinline__ void clear() {
    zero(z);
    k1[0] = k1[1] = 0.f;
  }
  // zq = x Z (from Z's two bf16 halves: Z is symmetric, so its row-layout registers are also its col-layout ones, a B
  // operand) and k1c[m][j] = the vector sum at this lane's columns 2(lane%4) + j + 8m.
  __device__ __forceinline__ void product(rt_fl<BASE, DK>& zq, float (&k1c)[2][2], const rt_bf<BASE, DK>& x) const {
    rt_bf<BASE, DK> zhi, zlo;
    copy(zhi, z);
    map_indexed(zlo, z, zhi, [](int, int, float v, float hi) { return v - hi; });
    zero(zq);
    mma_AB(zq, x, reinterpret_cast<const rt_bf<BASE, DK, col_layout>&>(zhi), zq);
    mma_AB(zq, x, reinterpret_cast<const rt_bf<BASE, DK, col_layout>&>(zlo), zq);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int j = 0; j < 2; ++j) k1c[m][j] = __shfl_sync(0xffffffffu, k1[m], 8 * (laneid() & 3) + 4 * j);
  }
  // The chunk's rows join the sums, each weighted by w[token] (nullptr: 1). xc holds x(j, b), x(j + 1, b) with
  // j = 2(lane%4) + 8(register / 2) + 16i and b = lane/4 + 8(register % 2); its registers are xᵀ's in row layout.
  __device__ __forceinline__ void add(const rt_bf<CHUNK, DK, col_layout>& xc, const float* w = nullptr) {
    const rt_bf<BASE, CHUNK>& xt = transposed(xc);
    float ks[2] = {0.f, 0.f};
    if (w == nullptr) {
      mma_AB(z, xt, xc, z);
      column_sums(ks, xc);
    } else {
      rt_bf<BASE, CHUNK> xw;  // xᵀ with each token's column weighted
#pragma unroll
      for (int i = 0; i < CHUNK / BASE; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int j = BASE * i + 2 * (laneid() & 3) + 8 * (k >> 1);
          const float2 pair = __bfloat1622float2(xt.tiles[0][i].data[k]), wj = *reinterpret_cast<const float2*>(w + j);
          xw.tiles[0][i].data[k] = __floats2bfloat162_rn(pair.x * wj.x, pair.y * wj.y);
          ks[k & 1] += pair.x * wj.x + pair.y * wj.y;
        }
      mma_AB(z, xw, xc, z);
    }
    reduce_into(k1, ks, 1.f);
  }
  // The chunk's rows leave the sums (kernel B's sums before a chunk: the whole sequence's, less the chunks scanned).
  __device__ __forceinline__ void sub(const rt_bf<CHUNK, DK, col_layout>& xc) {
    rt_fl<BASE, DK> t;
    zero(t);
    mma_AB(t, transposed(xc), xc, t);
    tk::sub(z, z, t);
    float ks[2] = {0.f, 0.f};
    column_sums(ks, xc);
    reduce_into(k1, ks, -1.f);
  }

 private:
  __device__ __forceinline__ static void column_sums(float (&ks)[2], const rt_bf<CHUNK, DK, col_layout>& xc) {
#pragma unroll
    for (int i = 0; i < CHUNK / BASE; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 pair = __bfloat1622float2(xc.tiles[i][0].data[k]);
        ks[k & 1] += pair.x + pair.y;
      }
  }
  __device__ __forceinline__ static void reduce_into(float (&dst)[2], float (&ks)[2], float sign) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      ks[i] += __shfl_xor_sync(0xffffffffu, ks[i], 1);
      ks[i] += __shfl_xor_sync(0xffffffffu, ks[i], 2);
      dst[i] += sign * ks[i];
    }
  }
};

// The normaliser's share of the previous chunks for this lane's rows (lane/4, lane/4 + 8): 64·chunks comes apart;
// den += Σ_b q_b (scale·K1_b + (scale²/2)(q Z)_b) over the lane's columns (zq = q Z, k1c as RowSums::product gives).
__device__ __forceinline__ void normaliser_share(float (&den)[2], const rt_fl<BASE, DK>& zq, const float (&k1c)[2][2],
                                                 const rt_bf<BASE, DK>& qr, float scale) {
  const float half_sq = 0.5f * scale * scale;
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // register k: row half k % 2, columns 2(lane%4) + 8(k / 2) + {0, 1}
    const float2 y = zq.tiles[0][0].data[k], q = __bfloat1622float2(qr.tiles[0][0].data[k]);
    den[k & 1] += q.x * (scale * k1c[k >> 1][0] + half_sq * y.x) + q.y * (scale * k1c[k >> 1][1] + half_sq * y.y);
  }
}

// The backward's inter-chunk Jacobian contraction, one A2 (or R2) tile's U = rows·state_Tᵀ: d[·, c] += scale²·x[·, a]
// U[·, (a, c)] over the tile's features a = 4T + w (the state is symmetric in (a, b), so φ's two Jacobian terms are
// one), x the rows' 16 inputs (q for dq, k for dk).
template <int A>
__device__ __forceinline__ void contract_block(rt_fl<BASE, DK>& d, const rt_base<float, row_layout>& u, const Frag& x,
                                               float scale_sq) {
  const float f[2] = {scale_sq * __bfloat162float(column_at<A, 0>(x).x), scale_sq * __bfloat162float(column_at<A, 1>(x).x)};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    d.tiles[0][0].data[k].x += f[k & 1] * u.data[k].x;
    d.tiles[0][0].data[k].y += f[k & 1] * u.data[k].y;
  }
}
template <int T, int... W>
__device__ __forceinline__ void contract(rt_fl<BASE, DK>& d, const rt_fl<BASE, DV_TILE>& u, const Frag& x, float scale_sq,
                                         std::integer_sequence<int, W...>) {
  (contract_block<4 * T + W>(d, u.tiles[0][W], x, scale_sq), ...);
}

// One state tile of a backward scan (T > 0; each kernel runs T = 0 itself, folding its earlier products into the
// first wait): U = rows·state_Tᵀ, contracted into d; state_T += φ_Tᵀ values with φ from the 16-wide rows of `feat`
// (read again here: its registers are not held across the contraction). At most two wgmma groups in flight.
template <int T>
__device__ __forceinline__ void grad_step(rt_fl<BASE, DK>& d, rt_fl<BASE, DV_TILE>& acc, rt_fl<BASE, DV_TILE>& u,
                                          rt_bf<BASE, CHUNK>& f, const rt_bf<BASE, DV_TILE>& rows, const Frag& x,
                                          const RowsTile& feat, const ValueTile& values, const StateCopy& state,
                                          float scale_sq) {
  warpgroup::mm_ABt(u, rows, state.quad[T]);
  warpgroup::mma_async_wait<1>(f);
  {
    rt_bf<CHUNK, DK, col_layout> fc;
    load(fc, feat);
    quad_features_k<T>(f, transposed(fc));
  }
  warpgroup::mma_AB(acc, f, values);
  warpgroup::mma_async_wait<1>(u);
  contract<T>(d, u, x, scale_sq, std::make_integer_sequence<int, DV_TILE / BASE>{});
}
// The backward's arguments, for both of its scans (based_backward.cu launches them as one grid).
struct BwdGlobals {
  tma_map<RowsTile> q, k;
  tma_map<ValueTile> v, dout;
  const bf16* k_rows;   // k itself, for kernel B's sums over the whole sequence
  int64_t k_stride[3];  // (b, h, n) in elements
  const float* delta;   // (B·H, N) do·o per row, normalising only
  float* dq;            // (B·H, N, 16), fp32
  float* dk;            // (B·H, N, 16), fp32
  bf16* dv;             // (B·H, N, dv)
  int H, N, dv_cols, tiles_v, blocks;  // blocks: each scan's (batch·head, value tile) blocks
  float scale, eps;
};

// The backward scans' double-buffered chunks: their shared memory starts with them.
struct BwdChunks {
  RowsTile q[2], k[2];
  ValueTile v[2], dout[2];
};

// A backward chunk (q, k and the block's columns of v and do) into buffer `buf` of a scan's shared memory.
template <class S>
__device__ __forceinline__ void load_bwd_chunk(S& s, int buf, const BwdGlobals& g, int b, int h, int vt, int c) {
  semaphore& bar = s.arrived[buf];
  expect_bytes(bar, 2 * RowsTile::bytes + 2 * ValueTile::bytes);
  tma::load_async(s.q[buf], g.q, bar, {b, h, c, 0});
  tma::load_async(s.k[buf], g.k, bar, {b, h, c, 0});
  tma::load_async(s.v[buf], g.v, bar, {b, h, c, vt});
  tma::load_async(s.dout[buf], g.dout, bar, {b, h, c, vt});
}

}  // namespace
}  // namespace tk_linear_attention
