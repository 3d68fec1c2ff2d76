// Plain linear attention, backward kernel A (plain_backward.cu): dq, a forward scan over the forward's state
// (plain.cu), one warpgroup per (batch·head, 64 value columns).
//
// With d = scale (rowsum(φQ φKᵀ ∘ causal) + φq·z), dn = do/(d + eps), dd = -(do·o)/(d + eps) (dn = do, dd = 0 without
// normalising) and the state before the chunk, H = Σ φk vᵀ and z = Σ φk:
//   dq = scale φ'(q) ∘ [ ((dn vᵀ + dd) ∘ causal) φK + dn Hᵀ + dd z ]
// then the state takes the chunk, as in the forward. Everything but the denominator is linear in the value columns: with several value tiles
// each adds its partial dq by fp32 atomics (dq is zeroed by the caller), the first with the dd terms; with one, dq is
// stored in bf16.
#pragma once
#include "plain.cuh"

namespace tk_linear_attention {
namespace {

template <int F> struct BwdGlobals {
  tma_map<FeatTile<F>> q, k;
  tma_map<Block> v, dout;
  const float* delta;  // (B·H, N) do·o per row, normalising only
  const float* ksum;   // (B·H, chunks, F) Σ φk of each chunk's rows below N, for kernel B (normalising only)
  float* dq;           // (B·H, N, F), fp32, value tiles adding into it; or, with one value tile, null and
  float* dk;           // dq_out / dk_out the (B·H, N, F) bf16 results
  bf16* dq_out;
  bf16* dk_out;
  bf16* dv;            // (B·H, N, dv)
  int H, N, dv_cols, tiles_v, blocks;  // blocks: each scan's (batch·head, value tile) blocks
  float scale, eps;
};

// The backward scans' double-buffered chunks: their shared memory starts with them.
template <int F> struct BwdChunks {
  FeatTile<F> q[2], k[2];
  Block v[2], dout[2];
  semaphore arrived[2];
};

template <int F>
__device__ __forceinline__ void load_bwd_chunk(BwdChunks<F>& s, int buf, const BwdGlobals<F>& g, int b, int h, int vt,
                                               int c) {
  semaphore& bar = s.arrived[buf];
  expect_bytes(bar, 2 * FeatTile<F>::bytes + 2 * Block::bytes);
  tma::load_async(s.q[buf], g.q, bar, {b, h, c, 0});
  tma::load_async(s.k[buf], g.k, bar, {b, h, c, 0});
  tma::load_async(s.v[buf], g.v, bar, {b, h, c, vt});
  tma::load_async(s.dout[buf], g.dout, bar, {b, h, c, vt});
}

template <int F> struct DqSmem : BwdChunks<F> {
  StateTile<F> state;  // H's bf16 copy before the current chunk
  float z[F];          // Σ φk over the previous chunks (normalize)
};

// Block `block` of the scan; raw: the block's (1024-aligned) shared memory.
template <int F, FeatureMap M, bool NORM>
__device__ __forceinline__ void dq_scan(const BwdGlobals<F>& g, uint8_t* raw, int block) {
  DqSmem<F>& s = *reinterpret_cast<DqSmem<F>*>(raw);
  const ScanBlock at(g, block);
  const int b = at.b, h = at.h, vt = at.vt, chunks = at.chunks;
  const int64_t rows = at.rows;
  const int lane = laneid(), row0 = BASE * warpid();
  const bool leader = threadIdx.x == 0;
  State<F> state;  // H
  start_scan<F>(s, state, [&] { load_bwd_chunk<F>(s, 0, g, b, h, vt, 0); }, [&](int i) { s.z[i] = 0.f; });

  for (int c = 0; c < chunks; ++c) {
    const int buf = c & 1;
    const int n0 = c * CHUNK + row0, n = n0 + (lane >> 2);  // this warp's rows from n0; this lane's n and n + 8
    float dl[2] = {0.f, 0.f};                               // their do·o
    if constexpr (NORM)
#pragma unroll
      for (int i = 0; i < 2; ++i) dl[i] = n + 8 * i < g.N ? g.delta[rows + n + 8 * i] : 0.f;
    wait(s.arrived[buf], (c >> 1) & 1);
    map_features<M>(s.q[buf], s.k[buf]);
    publish_state<F>(s.state, state);
    fence_async_shared();
    __syncthreads();  // φq, φk and H's copy are visible to wgmma; every warp is done with chunk c - 1's buffers
    if (leader && c + 1 < chunks) load_bwd_chunk<F>(s, buf ^ 1, g, b, h, vt, c + 1);

    rt_bf<BASE, DV_TILE> dn;  // do, then dn = do/(d + eps)
    load(dn, s.dout[buf], row0, 0);
    rt_bf<BASE, F> qr;  // this warp's φq rows
    load(qr, s.q[buf], row0, 0);
    float dd[2] = {0.f, 0.f};
    if constexpr (NORM) {  // d + eps as the forward computes it
      rt_fl<BASE, CHUNK> sc;
      warpgroup::mm_ABt(sc, s.q[buf], s.k[buf]);
      float den[2] = {0.f, 0.f};
      dot_rows<F>(den, qr, s.z);
      warpgroup::mma_async_wait<0>(sc);
      map_indexed(sc, sc, [&](int r, int col, float x) {
        den[r >> 3] += col <= row0 + r ? x : 0.f;
        return x;
      });
      float inv[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        inv[i] = 1.f / (g.scale * quad_sum(den[i]) + g.eps);
        dd[i] = vt == 0 ? -dl[i] * inv[i] : 0.f;  // the dd terms once per row: with the first value tile
      }
      map_indexed(dn, dn, [&](int r, int, float x) { return x * inv[r >> 3]; });
    }
    rt_fl<BASE, CHUNK> gw;  // dn vᵀ: this warp's queries by the chunk's keys
    warpgroup::mm_ABt(gw, dn, s.v[buf]);
    rt_fl<BASE, F> dqa;  // dn Hᵀ, then + W φK
    warpgroup::mm_ABt(dqa, dn, s.state);
    warpgroup::mma_async_wait<1>(gw);
    rt_bf<BASE, CHUNK> w;  // W = (G + dd) ∘ causal
    map_indexed(w, gw, [&](int r, int col, float x) { return col <= row0 + r ? x + dd[r >> 3] : 0.f; });
    warpgroup::mma_AB(dqa, w, s.k[buf]);
    update_state<F>(state, s.k[buf], s.v[buf]);
    warpgroup::mma_async_wait<0>(dqa, w, dn);
    hold_state<F>(state);
    write_grad_rows<M, F>(g.dq_out ? g.dq_out + rows * F : nullptr, g.dq ? g.dq + rows * F : nullptr, n0, g.N, dqa,
                          qr, g.scale, dd, NORM ? s.z : nullptr);
    __syncthreads();  // every warp has read z and H's copy, and its wgmmas are done
    if constexpr (NORM) add_column_sums<F>(s.z, s.k[buf]);  // read next after the next chunk's first barrier
  }
}

}  // namespace
}  // namespace tk_linear_attention
