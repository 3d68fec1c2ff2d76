// Based linear attention, backward kernel B (based_backward.cu runs it beside kernel A): dk and dv, a reverse scan on
// wgmma, one warpgroup per (batch·head, 64 value columns).
//
// With dn = do/(d + eps) and dd = -(do·o)/(d + eps) (dn = do, dd = 0 without normalising), the state of the later
// chunks (the forward's with q and dn for k and v): R2 = Σ (q_a q)ᵀ dn, R1ᵀ = dnᵀ q, R0 = Σ dn, r2 = Σ dd q qᵀ,
// r1 = Σ dd q (README "Backward: the equations"):
//   dv_j = Σ_{i ≥ j, this chunk} κ_ij dn_i + R0 + scale·k_j R1 + Σ_a (scale²/2 · k_a k_j) R2_a
//   dk_j = scale Σ_{i ≥ j, this chunk} (v_j·dn_i + dd_i)(1 + s_ij) q_i
//        + scale² Σ_a k_j[a] (U_j[a, ·] + r2[a, ·]) + scale (v_j·R1 + r1),    U_j = v_j R2ᵀ (16 x 16)
// dv is the forward's product with the roles of q and k swapped (the causal side above the diagonal); dk is kernel
// A's with q and k, dn and v swapped. The denominators d + eps of the chunk's queries come as the forward computes
// them, from Z = Σ k kᵀ and K1 = Σ k over the earlier chunks: the whole sequence's sums (a first pass over k), less
// each chunk as the scan reaches it; so kernel B needs nothing from kernel A. Per chunk, last to first: each warp's
// 16 query rows of dn (and dd) into shared memory, then dv (stored), then dk with the state's update one R2 tile at a
// time. dk is linear in the value columns: each value tile adds its partial by fp32 atomics (dk is zeroed by the
// caller), the first with the dd terms.
#pragma once
#include "based.cuh"

namespace tk_linear_attention {
namespace {

struct DkdvSmem : BwdChunks {
  ValueTile dn;               // this chunk's dn (normalising; else dout is dn)
  StateCopy state;            // bf16 copies of R2 and R1ᵀ (the later chunks)
  float dd[CHUNK];            // this chunk's dd (zero past N, in value tiles after the first, without normalising)
  float rsum[2][DV_TILE];     // R0 before this chunk, and after it (written by column, read by the next chunk)
  semaphore arrived[2];
};

// Z and K1 over the whole sequence, in every warp: warp w adds chunks w, w + 4, .. through a staging tile (the
// second dout buffer, not yet in use), and the warps' sums meet in shared memory (the dn tile, not yet in use).
__device__ __forceinline__ void sequence_sums(RowSums& sums, DkdvSmem& s, const BwdGlobals& g, int b, int h, int chunks) {
  const int warp = warpid(), lane = laneid();
  const bf16* k = g.k_rows + b * g.k_stride[0] + h * g.k_stride[1];
  RowsTile& stage = reinterpret_cast<RowsTile*>(s.dout[1].data)[warp];
  sums.clear();
  for (int c = warp; c < chunks; c += WARPGROUP_WARPS) {
    __syncwarp();  // the previous chunk's reads of the staging tile are done
#pragma unroll
    for (int i = 0; i < CHUNK * DK / 8 / 32; ++i) {  // 16-byte pieces: lane l takes row l / 2 + 16i, half l % 2
      const int r = (lane >> 1) + 16 * i, half = lane & 1, n = c * CHUNK + r;
      const uint4 piece = n < g.N ? *reinterpret_cast<const uint4*>(k + n * g.k_stride[2] + 8 * half) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(reinterpret_cast<char*>(stage.data) + RowsTile::offset(r, 8 * half)) = piece;
    }
    __syncwarp();
    rt_bf<CHUNK, DK, col_layout> kc;
    load(kc, stage);
    sums.add(kc);
  }
  float* part = reinterpret_cast<float*>(s.dn.data) + (warp * 32 + lane) * 10;  // this lane's registers of the sums
#pragma unroll
  for (int k = 0; k < 4; ++k) part[2 * k] = sums.z.tiles[0][0].data[k].x, part[2 * k + 1] = sums.z.tiles[0][0].data[k].y;
  part[8] = sums.k1[0], part[9] = sums.k1[1];
  __syncthreads();
  sums.clear();
#pragma unroll
  for (int w = 0; w < WARPGROUP_WARPS; ++w) {
    const float* o = reinterpret_cast<const float*>(s.dn.data) + (w * 32 + lane) * 10;
#pragma unroll
    for (int k = 0; k < 4; ++k) sums.z.tiles[0][0].data[k].x += o[2 * k], sums.z.tiles[0][0].data[k].y += o[2 * k + 1];
    sums.k1[0] += o[8], sums.k1[1] += o[9];
  }
  __syncthreads();  // the dn tile and the staging buffer are free again
}

// Block `block` of the scan; raw: the block's (1024-aligned) shared memory.
template <bool NORM>
__device__ __forceinline__ void dkdv_scan(const BwdGlobals& g, uint8_t* raw, int block) {
  DkdvSmem& s = *reinterpret_cast<DkdvSmem*>(raw);
  const int bh = block / g.tiles_v, vt = block % g.tiles_v, b = bh / g.H, h = bh % g.H;
  const int lane = laneid(), warp = warpid(), row0 = BASE * warp;
  const int chunks = (g.N + CHUNK - 1) / CHUNK;
  const bool leader = threadIdx.x == 0;
  const float scale = g.scale, scale_sq = scale * scale;
  const float* delta = NORM ? g.delta + int64_t(bh) * g.N : nullptr;
  float* dk = g.dk + int64_t(bh) * g.N * DK;
  bf16* dv = g.dv + int64_t(bh) * g.N * g.dv_cols + vt * DV_TILE;
  if (leader) {
    init_semaphore(s.arrived[0], 1);
    init_semaphore(s.arrived[1], 1);
    fence_semaphore_init();
    load_bwd_chunk(s, 0, g, b, h, vt, chunks - 1);
  }
  for (int i = threadIdx.x; i < DV_TILE; i += WARPGROUP_THREADS) s.rsum[0][i] = 0.f;
  rt_fl<BASE, DV_TILE> quad[QUAD_TILES];  // R2 (unscaled: Σ q_a q_b dn)
  rt_fl<BASE, DK> lin;                    // R1ᵀ (unscaled)
  RowSums dsums;                          // normalize, first value tile: r2 = Σ dd q qᵀ, r1 = Σ dd q
  RowSums sums;                           // normalize: Z = Σ k kᵀ, K1 = Σ k over the chunks before the current one
#pragma unroll
  for (int t = 0; t < QUAD_TILES; ++t) zero(quad[t]);
  zero(lin);
  dsums.clear();
  __syncthreads();
  if constexpr (NORM) sequence_sums(sums, s, g, b, h, chunks);

  for (int it = 0; it < chunks; ++it) {
    const int c = chunks - 1 - it, buf = it & 1, cur = it & 1;
    publish_state(s.state, quad, lin);
    const int n0 = c * CHUNK + row0 + (lane >> 2);  // this lane's query rows now, its key rows below: n0 and n0 + 8
    float dl[2] = {0.f, 0.f};                        // the query rows' do·o
    if constexpr (NORM)
#pragma unroll
      for (int i = 0; i < 2; ++i) dl[i] = n0 + 8 * i < g.N ? delta[n0 + 8 * i] : 0.f;
    wait(s.arrived[buf], (it >> 1) & 1);
    if constexpr (NORM) {  // this warp's 16 query rows: d + eps as the forward computes it, then dn and dd
      rt_fl<BASE, CHUNK> sq;  // q kᵀ
      warpgroup::mm_ABt(sq, s.q[buf], s.k[buf]);
      {
        rt_bf<CHUNK, DK, col_layout> kc;
        load(kc, s.k[buf]);
        sums.sub(kc);  // now over the chunks before c
      }
      rt_bf<BASE, DK> qr;
      load(qr, s.q[buf], row0, 0);
      warpgroup::mma_async_wait<0>(sq);
      float den[2] = {0.f, 0.f};
      map_indexed(sq, sq, [&](int r, int col, float qk) {
        const float x = scale * qk;
        den[r >> 3] += col <= row0 + r ? 1.f + x + 0.5f * x * x : 0.f;
        return qk;
      });
      {
        rt_fl<BASE, DK> zq;
        float k1c[2][2];
        sums.product(zq, k1c, qr);
        normaliser_share(den, zq, k1c, qr, scale);
      }
      float inv[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        inv[i] = 1.f / (quad_sum(den[i]) + float(CHUNK) * c + g.eps);
        const float dd = vt == 0 && n0 + 8 * i < g.N ? -dl[i] * inv[i] : 0.f;  // the dd terms with the first tile
        if ((lane & 3) == 0) s.dd[row0 + (lane >> 2) + 8 * i] = dd;
      }
      rt_bf<BASE, DV_TILE> dnr;
      load(dnr, s.dout[buf], row0, 0);
      map_indexed(dnr, dnr, [&](int r, int, float x) { return x * inv[r >> 3]; });
      warpgroup::store(s.dn, dnr);
    }
    const ValueTile& dn = NORM ? s.dn : s.dout[buf];
    fence_async_shared();
    __syncthreads();  // dn, dd and the state copies are visible; every warp is done with chunk c + 1
    if (leader && it + 1 < chunks) load_bwd_chunk(s, buf ^ 1, g, b, h, vt, c - 1);

    // ---- dv for this warp's 16 key rows
    rt_fl<BASE, CHUNK> sk;  // k_j · q_i: this warp's keys by the chunk's queries
    warpgroup::mm_ABt(sk, s.k[buf], s.q[buf]);
    rt_bf<BASE, DK> kr, kl, ks;  // this warp's k rows: as read, times scale, times scale/√2
    load(kr, s.k[buf], row0, 0);
    map_indexed(kl, kr, [&](int, int, float x) { return scale * x; });
    map_indexed(ks, kr, [&](int, int, float x) { return 0.70710678f * scale * x; });
    rt_fl<BASE, DV_TILE> dva;  // starts at R0
    zero(dva);
    map_indexed(dva, dva, [&](int, int col, float) { return s.rsum[cur][col]; });
    warpgroup::mma_async_wait<0>(sk);
    rt_bf<BASE, CHUNK> kap;  // κ on and above the diagonal (queries at or after the key)
    map_indexed(kap, sk, [&](int r, int col, float kq) {
      const float x = scale * kq;
      return col >= row0 + r ? 1.f + x + 0.5f * x * x : 0.f;
    });
    warpgroup::mma_AB(dva, kap, dn);
    warpgroup::mma_ABt(dva, kl, s.state.lin);
    {
      rt_bf<BASE, DV_TILE> f0, f1;  // φk tiles (ks_a ks_b), two in flight
      quad_features_q<0>(f0, ks.tiles[0][0], std::make_integer_sequence<int, DV_TILE / BASE>{});
      warpgroup::mma_async_wait<0>(kap, kl);  // (their registers are needed for the φ tiles)
      warpgroup::mma_AB(dva, f0, s.state.quad[0]);
      quad_features_q<1>(f1, ks.tiles[0][0], std::make_integer_sequence<int, DV_TILE / BASE>{});
      warpgroup::mma_AB(dva, f1, s.state.quad[1]);
      warpgroup::mma_async_wait<1>(f0);
      quad_features_q<2>(f0, ks.tiles[0][0], std::make_integer_sequence<int, DV_TILE / BASE>{});
      warpgroup::mma_AB(dva, f0, s.state.quad[2]);
      warpgroup::mma_async_wait<1>(f1);
      quad_features_q<3>(f1, ks.tiles[0][0], std::make_integer_sequence<int, DV_TILE / BASE>{});
      warpgroup::mma_AB(dva, f1, s.state.quad[3]);
      warpgroup::mma_async_wait<0>(dva, f0, f1);
    }
#pragma unroll
    for (int m = 0; m < DV_TILE / BASE; ++m)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int n = n0 + 8 * (k & 1);
        if (n < g.N)
          *reinterpret_cast<bf16_2*>(dv + int64_t(n) * g.dv_cols + BASE * m + base_col<row_layout>(k, 0)) =
              __floats2bfloat162_rn(dva.tiles[0][m].data[k].x, dva.tiles[0][m].data[k].y);
      }

    // ---- dk for the same rows; the state takes the chunk's queries
    rt_bf<BASE, DV_TILE> vr;  // this warp's v rows
    load(vr, s.v[buf], row0, 0);
    rt_fl<BASE, CHUNK> gt;  // v_j · dn_i
    warpgroup::mm_ABt(gt, vr, dn);
    warpgroup::mm_ABt(sk, s.k[buf], s.q[buf]);  // again: cheaper than holding it (or its factor) through dv
    rt_fl<BASE, DK> ul;  // v_j · R1[c, ·] (R1ᵀ's rows are value columns)
    warpgroup::mm_AB(ul, vr, s.state.lin);
    rt_fl<BASE, DK> dkc;  // the inter-chunk terms, on the CUDA cores
    zero(dkc);
    if constexpr (NORM) {  // the dd terms: scale² (k r2) + scale r1 (zero but in the first value tile)
      rt_fl<BASE, DK> rk;
      float r1c[2][2];
      dsums.product(rk, r1c, kr);
      map_indexed(dkc, rk, [&](int, int col, float y) { return scale_sq * y + scale * r1c[(col >> 3) & 1][col & 1]; });
    }
    warpgroup::mma_async_wait<0>(gt, sk, ul);
    rt_bf<BASE, CHUNK> wt;  // (G + dd_i) ∘ scale(1 + s), the causal side
    map_indexed(wt, gt, sk, [&](int r, int col, float gv, float kq) {
      return col >= row0 + r ? (gv + (NORM ? s.dd[col] : 0.f)) * scale * (1.f + scale * kq) : 0.f;
    });
    rt_fl<BASE, DK> dka;  // the intra-chunk term
    warpgroup::mm_AB(dka, wt, s.q[buf]);

    rt_fl<BASE, DV_TILE> u;
    rt_bf<BASE, CHUNK> fq;
    warpgroup::mm_ABt(u, vr, s.state.quad[0]);
    warpgroup::mma_async_wait<1>(dka, wt);  // (U_0 may still run)
    map_indexed(dkc, dkc, ul, [&](int, int, float d, float x) { return d + scale * x; });
    add(dkc, dkc, dka);
    {
      rt_bf<CHUNK, DK, col_layout> qc;
      load(qc, s.q[buf]);
      quad_features_k<0>(fq, transposed(qc));
    }
    warpgroup::mma_AB(quad[0], fq, dn);
    warpgroup::mma_async_wait<1>(u);
    contract<0>(dkc, u, kr.tiles[0][0], scale_sq, std::make_integer_sequence<int, DV_TILE / BASE>{});
    grad_step<1>(dkc, quad[1], u, fq, vr, kr.tiles[0][0], s.q[buf], dn, s.state, scale_sq);
    grad_step<2>(dkc, quad[2], u, fq, vr, kr.tiles[0][0], s.q[buf], dn, s.state, scale_sq);
    grad_step<3>(dkc, quad[3], u, fq, vr, kr.tiles[0][0], s.q[buf], dn, s.state, scale_sq);
    warpgroup::mma_AtB(lin, dn, s.q[buf]);  // R1ᵀ += dnᵀ q
    if constexpr (NORM) {
      if (vt == 0) {
        rt_bf<CHUNK, DK, col_layout> qc;
        load(qc, s.q[buf]);
        dsums.add(qc, s.dd);
      }
    }
    {  // R0 after this chunk: warp w sums columns 16w.., lane l column 16w + l % 16 over half the rows
      const int col = BASE * warp + (lane & 15), r0 = (CHUNK / 2) * (lane >> 4);
      float sum = 0.f;
#pragma unroll 8
      for (int r = 0; r < CHUNK / 2; ++r) sum += __bfloat162float(dn(r0 + r, col));
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      if (lane < 16) s.rsum[cur ^ 1][col] = s.rsum[cur][col] + sum;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = n0 + 8 * (k & 1), col = base_col<row_layout>(k, 0);
      if (r >= g.N) continue;
      atomicAdd(dk + int64_t(r) * DK + col, dkc.tiles[0][0].data[k].x);
      atomicAdd(dk + int64_t(r) * DK + col + 1, dkc.tiles[0][0].data[k].y);
    }
    warpgroup::mma_async_wait<0>(quad[3], lin, fq, vr);
    __syncthreads();  // every warp is done with dn, dd and the state copies before the next chunk replaces them
  }
}

}  // namespace
}  // namespace tk_linear_attention
