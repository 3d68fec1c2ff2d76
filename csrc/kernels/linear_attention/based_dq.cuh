// Based linear attention, backward kernel A (based_backward.cu runs it beside kernel B): dq, a forward scan on wgmma
// with the forward's state (based.cu), one warpgroup per (batch·head, 64 value columns).
//
// With dn = do/(d + eps), dd = -(do·o)/(d + eps) (dn = do, dd = 0 without normalising) and the forward's state before
// the chunk (A2 = Σ (k_a k)ᵀ v, A1 = Σ kᵀ v, Z = Σ k kᵀ, K1 = Σ k; README "Backward: the equations"):
//   dq_i = scale Σ_{j ≤ i, this chunk} (dn_i·v_j + dd_i)(1 + s_ij) k_j
//        + scale² Σ_a q_i[a] (U_i[a, ·] + dd_i Z[a, ·])  +  scale (dn_i A1 + dd_i K1),     U_i = dn_i A2ᵀ (16 x 16)
// (A2 and Z are symmetric in (a, b), so φq's two Jacobian terms are one). Per chunk: the scores and the denominator as
// the forward computes them, G = dn vᵀ, W = (G + dd) ∘ scale(1 + s) ∘ causal and W k on wgmma; U = dn A2ᵀ one A2 tile
// at a time (wgmma), contracted with q's columns on the CUDA cores; then the state takes the chunk's k and v, as in
// the forward. Everything but the denominator is linear in the value columns: each value tile adds its partial dq
// by fp32 atomics (dq is zeroed by the caller); the first adds the dd terms.
#pragma once
#include "based.cuh"

namespace tk_linear_attention {
namespace {

struct DqSmem : BwdChunks {
  StateCopy state;  // bf16 copies of A2 and A1ᵀ before the current chunk
  semaphore arrived[2];
};

// Block `block` of the scan; raw: the block's (1024-aligned) shared memory.
template <bool NORM>
__device__ __forceinline__ void dq_scan(const BwdGlobals& g, uint8_t* raw, int block) {
  DqSmem& s = *reinterpret_cast<DqSmem*>(raw);
  const int bh = block / g.tiles_v, vt = block % g.tiles_v, b = bh / g.H, h = bh % g.H;
  const int lane = laneid(), row0 = BASE * warpid();
  const int chunks = (g.N + CHUNK - 1) / CHUNK;
  const bool leader = threadIdx.x == 0;
  const float scale = g.scale, scale_sq = scale * scale;
  const float* delta = NORM ? g.delta + int64_t(bh) * g.N : nullptr;
  float* dq = g.dq + int64_t(bh) * g.N * DK;
  if (leader) {
    init_semaphore(s.arrived[0], 1);
    init_semaphore(s.arrived[1], 1);
    fence_semaphore_init();
    load_bwd_chunk(s, 0, g, b, h, vt, 0);
  }
  rt_fl<BASE, DV_TILE> quad[QUAD_TILES];  // A2
  rt_fl<BASE, DK> lin;                    // A1ᵀ
  RowSums sums;                           // normalize: Z = Σ k kᵀ, K1 = Σ k over the previous chunks
#pragma unroll
  for (int t = 0; t < QUAD_TILES; ++t) zero(quad[t]);
  zero(lin);
  sums.clear();
  __syncthreads();

  for (int c = 0; c < chunks; ++c) {
    const int buf = c & 1;
    publish_state(s.state, quad, lin);
    const int n0 = c * CHUNK + row0 + (lane >> 2);  // this lane's rows: n0 and n0 + 8
    float dl[2] = {0.f, 0.f};                        // their do·o
    if constexpr (NORM)
#pragma unroll
      for (int i = 0; i < 2; ++i) dl[i] = n0 + 8 * i < g.N ? delta[n0 + 8 * i] : 0.f;
    fence_async_shared();
    __syncthreads();  // the copies are visible to wgmma; every warp is done with chunk c - 1 and its buffers
    if (leader && c + 1 < chunks) load_bwd_chunk(s, buf ^ 1, g, b, h, vt, c + 1);
    wait(s.arrived[buf], (c >> 1) & 1);

    rt_fl<BASE, CHUNK> sc;  // q kᵀ, this warp's 16 rows
    warpgroup::mm_ABt(sc, s.q[buf], s.k[buf]);
    rt_bf<BASE, DK> qr;
    load(qr, s.q[buf], row0, 0);
    rt_bf<BASE, DV_TILE> dn;  // do, then dn = do/(d + eps)
    load(dn, s.dout[buf], row0, 0);
    warpgroup::mma_async_wait<0>(sc);
    float den[2] = {0.f, 0.f};  // normalize: this lane's share of its rows' sums (rows n0 and n0 + 8)
    rt_bf<BASE, CHUNK> fac;     // ∂κ/∂(q·k) = scale(1 + s) on and below the diagonal
    map_indexed(fac, sc, [&](int r, int col, float qk) {
      const float x = scale * qk;
      const bool on = col <= row0 + r;
      if constexpr (NORM) den[r >> 3] += on ? 1.f + x + 0.5f * x * x : 0.f;
      return on ? scale * (1.f + x) : 0.f;
    });
    float dd[2] = {0.f, 0.f};
    rt_fl<BASE, DK> dqc;  // the inter-chunk terms, on the CUDA cores
    zero(dqc);
    if constexpr (NORM) {  // d_i as the forward computes it; the dd terms of the inter-chunk gradient
      rt_fl<BASE, DK> zq;
      float k1c[2][2];
      sums.product(zq, k1c, qr);
      normaliser_share(den, zq, k1c, qr, scale);
      float inv[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        inv[i] = 1.f / (quad_sum(den[i]) + float(CHUNK) * c + g.eps);
        dd[i] = vt == 0 ? -dl[i] * inv[i] : 0.f;  // the dd terms once per row: with the first value tile
      }
      map_indexed(dn, dn, [&](int r, int, float x) { return x * inv[r >> 3]; });
      map_indexed(dqc, zq, [&](int r, int col, float y) {
        return dd[r >> 3] * (scale_sq * y + scale * k1c[(col >> 3) & 1][col & 1]);
      });
    }
    rt_fl<BASE, CHUNK> gw;  // dn vᵀ: this warp's queries by the chunk's keys
    warpgroup::mm_ABt(gw, dn, s.v[buf]);
    rt_fl<BASE, DK> ul;  // dn A1
    warpgroup::mm_AB(ul, dn, s.state.lin);
    warpgroup::mma_async_wait<1>(gw);
    rt_bf<BASE, CHUNK> w;  // (G + dd) ∘ scale(1 + s), causal
    map_indexed(w, gw, fac, [&](int r, int, float gv, float f) { return (gv + dd[r >> 3]) * f; });
    rt_fl<BASE, DK> dqa;  // the intra-chunk term
    warpgroup::mm_AB(dqa, w, s.k[buf]);
    rt_fl<BASE, DV_TILE> u;
    rt_bf<BASE, CHUNK> fk;
    warpgroup::mm_ABt(u, dn, s.state.quad[0]);
    warpgroup::mma_async_wait<1>(ul, dqa, w);  // (U_0 may still run)
    map_indexed(dqc, dqc, ul, [&](int, int, float d, float x) { return d + scale * x; });
    add(dqc, dqc, dqa);
    {
      rt_bf<CHUNK, DK, col_layout> kc;
      load(kc, s.k[buf]);
      quad_features_k<0>(fk, transposed(kc));
    }
    warpgroup::mma_AB(quad[0], fk, s.v[buf]);
    warpgroup::mma_async_wait<1>(u);
    contract<0>(dqc, u, qr.tiles[0][0], scale_sq, std::make_integer_sequence<int, DV_TILE / BASE>{});
    grad_step<1>(dqc, quad[1], u, fk, dn, qr.tiles[0][0], s.k[buf], s.v[buf], s.state, scale_sq);
    grad_step<2>(dqc, quad[2], u, fk, dn, qr.tiles[0][0], s.k[buf], s.v[buf], s.state, scale_sq);
    grad_step<3>(dqc, quad[3], u, fk, dn, qr.tiles[0][0], s.k[buf], s.v[buf], s.state, scale_sq);
    warpgroup::mma_AtB(lin, s.v[buf], s.k[buf]);  // A1ᵀ += vᵀ k
    if constexpr (NORM) {
      rt_bf<CHUNK, DK, col_layout> kc;
      load(kc, s.k[buf]);
      sums.add(kc);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = n0 + 8 * (k & 1), col = base_col<row_layout>(k, 0);
      if (r >= g.N) continue;
      atomicAdd(dq + int64_t(r) * DK + col, dqc.tiles[0][0].data[k].x);
      atomicAdd(dq + int64_t(r) * DK + col + 1, dqc.tiles[0][0].data[k].y);
    }
    warpgroup::mma_async_wait<0>(quad[3], lin, fk, dn);
    __syncthreads();  // every warp's wgmmas have read this chunk's state copies before the next chunk replaces them
  }
}

}  // namespace
}  // namespace tk_linear_attention
