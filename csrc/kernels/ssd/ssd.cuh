// What the SSD forward (ssd.cu) and backward (ssd_backward.cu) share: the chunk constants, the block's rows and
// their chunk loads, a token's value from the lanes' pairs, the chunk's decays and their causal mask, and the owner
// warps' fp32 state rows (read, written, published as bf16).
#pragma once
#include <tk/tk.cuh>
#include <tk/ops/thread/cp_async.cuh>
#include <tk/ops/warp/mma.cuh>

#include "ssd.h"

namespace tk_ssd {
namespace {

using namespace tk;

constexpr int CHUNK = 64, WARPS = 8, THREADS = WARPS * 32;

template <int NS>
struct Rows {  // this block's rows in global memory, and their strides (elements)
  const bf16* x;
  const bf16* b;
  const bf16* c;
  const float* dt;
  int64_t x_row, bc_row, dt_row;
  int l;
};

// x, B, C and dt of chunk c into buffer `buf` of a shared struct with those members, as one cp.async group; rows
// past l are zero-filled (dt = 0: no decay, no input).
template <int NS, class S>
__device__ __forceinline__ void load_chunk(S& s, int buf, const Rows<NS>& g, int c) {
  using XT = std::remove_reference_t<decltype(s.x[0])>;
  using BT = st<bf16, CHUNK, NS>;
  constexpr int PT = XT::cols;
  const int tid = threadIdx.x, n0 = c * CHUNK;
#pragma unroll
  for (int i = 0; i < CHUNK * PT / 8 / THREADS; ++i) {  // x: PT / 8 segments of 8 per row
    const int t = tid + i * THREADS, r = t / (PT / 8), seg = t % (PT / 8), n = n0 + r;
    const bool ok = n < g.l;
    cp_async16(smem_addr(s.x[buf].data) + XT::offset(r, seg * 8), g.x + (ok ? n * g.x_row + seg * 8 : 0), ok);
  }
#pragma unroll
  for (int i = 0; i < CHUNK * NS / 8 / THREADS; ++i) {  // B and C: n/8 segments per row
    const int t = tid + i * THREADS, r = t / (NS / 8), seg = t % (NS / 8), n = n0 + r;
    const bool ok = n < g.l;
    const int64_t off = ok ? n * g.bc_row + seg * 8 : 0;
    cp_async16(smem_addr(s.b[buf].data) + BT::offset(r, seg * 8), g.b + off, ok);
    cp_async16(smem_addr(s.c[buf].data) + BT::offset(r, seg * 8), g.c + off, ok);
  }
  if (tid < CHUNK) {
    const bool ok = n0 + tid < g.l;
    cp_async4(smem_addr(&s.dt[buf][tid]), g.dt + (ok ? (n0 + tid) * g.dt_row : 0), ok);
  }
  cp_async_commit();
}

// The value of token t (0..63) from the lanes' pairs (lane holds tokens 2·lane and 2·lane + 1). All lanes must call
// it (shuffles).
__device__ __forceinline__ float pair_at(float v0, float v1, int t) {
  const float a0 = __shfl_sync(0xffffffffu, v0, t >> 1), a1 = __shfl_sync(0xffffffffu, v1, t >> 1);
  return (t & 1) ? a1 : a0;
}

// Λ inside a chunk (the inclusive cumulative sum of a = dt·A), two tokens per lane: lane holds tokens 2·lane and
// 2·lane + 1 (Λ in l0, l1; dt in dt0, dt1); every lane holds Λ_end. Every warp computes it (a shuffle scan).
struct Decays {
  float dt0, dt1, l0, l1, l_end;
  // Λ or dt of token t (0..63); all lanes must call them (shuffles)
  __device__ __forceinline__ float lam(int t) const { return pair_at(l0, l1, t); }
  __device__ __forceinline__ float dt(int t) const { return pair_at(dt0, dt1, t); }
  // the same for a t of one parity in every lane (a register tile's column in map_indexed): one shuffle
  __device__ __forceinline__ float lam_col(int t) const { return __shfl_sync(0xffffffffu, t & 1 ? l1 : l0, t >> 1); }
  __device__ __forceinline__ float dt_col(int t) const { return __shfl_sync(0xffffffffu, t & 1 ? dt1 : dt0, t >> 1); }
};

template <class S>
__device__ __forceinline__ Decays chunk_decays(const S& s, int buf, float Ah) {
  const int lane = laneid();
  Decays d;
  d.dt0 = s.dt[buf][2 * lane], d.dt1 = s.dt[buf][2 * lane + 1];
  const float a0 = d.dt0 * Ah, a1 = d.dt1 * Ah;
  float run = a0 + a1;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, run, off);
    if (lane >= off) run += up;
  }
  d.l1 = run, d.l0 = run - a1, d.l_end = __shfl_sync(0xffffffffu, run, 31);
  return d;
}

// dst = scores ∘ the causal decay between a warp's 16 rows (row0 + r; their Λ in lrow, rows r and r + 8) and the
// chunk's 64 tokens as columns, times weight(r, col): lower (col ≤ row) exp(Λ_row − Λ_col), upper (col ≥ row)
// exp(Λ_col − Λ_row), zero elsewhere. A lower weight is evaluated by every lane (it may shuffle, as Decays::dt_col);
// an upper one only where the mask is on.
template <bool UPPER, class Weight>
__device__ __forceinline__ void causal_decay(rt_bf<BASE, CHUNK>& dst, const rt_fl<BASE, CHUNK>& scores,
                                             const Decays& d, const float (&lrow)[2], int row0, Weight&& weight) {
  map_indexed(dst, scores, [&](int r, int col, float v) {
    const float lc = d.lam_col(col);  // every lane shuffles
    if constexpr (UPPER) return col >= row0 + r ? v * __expf(lc - lrow[r >> 3]) * weight(r, col) : 0.f;
    const float w = weight(r, col);  // (may shuffle too: every lane)
    return col <= row0 + r ? v * __expf(lrow[r >> 3] - lc) * w : 0.f;
  });
}

// An owner warp's 16 state dims (rows of the transposed state, n x p) from a (b, nh, p, n) fp32 tensor at `base`
// (zero without one), and back.
template <int NS, int PT>
__device__ __forceinline__ void read_state(rt_fl<BASE, PT>& S, const float* src, int64_t base, int warp) {
#pragma unroll
  for (int j = 0; j < PT / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float2 v = make_float2(0.f, 0.f);
      if (src) {
        const int r = BASE * warp + base_row<row_layout>(k, 0), cc = BASE * j + base_col<row_layout>(k, 0);
        v.x = src[base + int64_t(cc) * NS + r];
        v.y = src[base + int64_t(cc + 1) * NS + r];
      }
      S.tiles[0][j].data[k] = v;
    }
}

template <int NS, int PT>
__device__ __forceinline__ void write_state(float* dst, const rt_fl<BASE, PT>& S, int64_t base, int warp) {
#pragma unroll
  for (int j = 0; j < PT / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = BASE * warp + base_row<row_layout>(k, 0), cc = BASE * j + base_col<row_layout>(k, 0);
      dst[base + int64_t(cc) * NS + r] = S.tiles[0][j].data[k].x;
      dst[base + int64_t(cc + 1) * NS + r] = S.tiles[0][j].data[k].y;
    }
}

// Publishes an owner warp's state rows as the bf16 copy every warp reads.
template <int PT, class S>
__device__ __forceinline__ void publish_state(S& s, const rt_fl<BASE, PT>& state, int warp) {
  rt_bf<BASE, PT> copy_bf;
  copy(copy_bf, state);
  store(s.state, copy_bf, BASE * warp, 0);
}

}  // namespace
}  // namespace tk_ssd
