// Plain linear attention, backward kernel B (plain_backward.cu): dk and dv, a reverse scan, one warpgroup per
// (batch·head, 64 value columns).
//
// With dn and dd as kernel A's and the state of the later chunks, R = Σ φq dnᵀ (dk x 64) and r = Σ dd φq:
//   dv = scale [ (φK φQᵀ ∘ causalᵀ) dn + φK R ]
//   dk = scale φ'(k) ∘ [ ((v dnᵀ + ddᵀ) ∘ causalᵀ) φQ + v Rᵀ + r ]
// then R += φQᵀ dn, r += Σ dd φq. Normalising, the chunk's denominators come as the forward computes them, from
// z = Σ φk over the earlier chunks: the sum of the key-sums launch's chunk sums, less each chunk as the scan passes
// it, so kernel B needs nothing from kernel A. dv is stored from registers; dk is linear in the value columns, so
// with several value tiles each adds its partial by fp32 atomics (dk is zeroed by the caller), the first with the dd
// terms; with one, dk is stored in bf16.
#pragma once
#include "plain_dq.cuh"

namespace tk_linear_attention {
namespace {

template <int F> struct DkdvSmem : BwdChunks<F> {
  Block dn;            // this chunk's dn (normalising; else dout is dn)
  StateTile<F> state;  // R's bf16 copy (the later chunks)
  float dd[CHUNK];     // this chunk's dd (zero past N and in value tiles after the first)
  float r[F];          // Σ dd φq over the later chunks
  float z[F];          // Σ φk over the earlier chunks (normalize)
};

template <int F, FeatureMap M, bool NORM>
__device__ __forceinline__ void dkdv_scan(const BwdGlobals<F>& g, uint8_t* raw, int block) {
  DkdvSmem<F>& s = *reinterpret_cast<DkdvSmem<F>*>(raw);
  const ScanBlock at(g, block);
  const int bh = at.bh, b = at.b, h = at.h, vt = at.vt, chunks = at.chunks;
  const int64_t rows = at.rows;
  const int lane = laneid(), row0 = BASE * warpid();
  const bool leader = threadIdx.x == 0;
  bf16* dv = g.dv + rows * g.dv_cols + vt * DV_TILE;
  if (leader) {
    init_semaphore(s.arrived[0], 1);
    init_semaphore(s.arrived[1], 1);
    fence_semaphore_init();
    load_bwd_chunk<F>(s, 0, g, b, h, vt, chunks - 1);
  }
  const float* ksum = NORM ? g.ksum + int64_t(bh) * chunks * F : nullptr;
  for (int i = threadIdx.x; i < F; i += WARPGROUP_THREADS) {
    s.r[i] = 0.f;
    if constexpr (NORM) {  // z before the last chunk
      float z = 0.f;
#pragma unroll 8
      for (int c = 0; c + 1 < chunks; ++c) z += ksum[c * F + i];
      s.z[i] = z;
    }
  }
  State<F> state;  // R
  zero_state<F>(state);
  __syncthreads();

  for (int it = 0; it < chunks; ++it) {
    const int c = chunks - 1 - it, buf = it & 1;
    const int n0 = c * CHUNK + row0, n = n0 + (lane >> 2);  // this warp's rows (queries, then keys) from n0
    wait(s.arrived[buf], (it >> 1) & 1);
    map_features<M>(s.q[buf], s.k[buf]);
    publish_state<F>(s.state, state);
    float dl[2] = {0.f, 0.f};  // the query rows' do·o
    float zsub = 0.f;          // chunk c - 1's Σ φk at this thread's column, loaded well before its use
    if constexpr (NORM) {
      if (threadIdx.x < F && c > 0) zsub = ksum[(c - 1) * F + threadIdx.x];
#pragma unroll
      for (int i = 0; i < 2; ++i) dl[i] = n + 8 * i < g.N ? g.delta[rows + n + 8 * i] : 0.f;
      fence_async_shared();
      __syncthreads();  // φq and φk are visible to wgmma
      // this warp's 16 query rows: d + eps as the forward computes it, then dn and dd
      rt_fl<BASE, CHUNK> sq;
      warpgroup::mm_ABt(sq, s.q[buf], s.k[buf]);
      float den[2] = {0.f, 0.f};
      {
        rt_bf<BASE, F> qr;
        load(qr, s.q[buf], row0, 0);
        dot_rows<F>(den, qr, s.z);
      }
      warpgroup::mma_async_wait<0>(sq);
      map_indexed(sq, sq, [&](int r, int col, float x) {
        den[r >> 3] += col <= row0 + r ? x : 0.f;
        return x;
      });
      float inv[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        inv[i] = 1.f / (g.scale * quad_sum(den[i]) + g.eps);
        const float dd = vt == 0 && n + 8 * i < g.N ? -dl[i] * inv[i] : 0.f;
        if ((lane & 3) == 0) s.dd[row0 + (lane >> 2) + 8 * i] = dd;
      }
      rt_bf<BASE, DV_TILE> dnr;
      load(dnr, s.dout[buf], row0, 0);
      map_indexed(dnr, dnr, [&](int r, int, float x) { return x * inv[r >> 3]; });
      store(s.dn, dnr, row0, 0);
    }
    const Block& dn = NORM ? s.dn : s.dout[buf];
    fence_async_shared();
    __syncthreads();  // φq, φk, dn, dd and R's copy are visible; every warp is done with chunk c + 1's buffers
    if (leader && it + 1 < chunks) load_bwd_chunk<F>(s, buf ^ 1, g, b, h, vt, c - 1);
    if constexpr (NORM)  // z before chunk c - 1 (every warp has read z before chunk c; read next after the last barrier)
      if (threadIdx.x < F && c > 0) s.z[threadIdx.x] -= zsub;

    // ---- dv for this warp's 16 key rows
    rt_fl<BASE, CHUNK> sk;  // φk_j · φq_i: this warp's keys by the chunk's queries
    warpgroup::mm_ABt(sk, s.k[buf], s.q[buf]);
    rt_fl<BASE, DV_TILE> dva;  // φK R, then + the intra-chunk term
    warpgroup::mm_AB(dva, s.k[buf], s.state);
    warpgroup::mma_async_wait<1>(sk);
    rt_bf<BASE, CHUNK> kap;  // the scores on and above the diagonal (queries at or after the key)
    map_indexed(kap, sk, [&](int r, int col, float x) { return col >= row0 + r ? x : 0.f; });
    warpgroup::mma_AB(dva, kap, dn);
    // ---- dk for the same rows
    rt_fl<BASE, CHUNK> gt;  // v_j · dn_i
    warpgroup::mm_ABt(gt, s.v[buf], dn);
    rt_fl<BASE, F> dka;  // v Rᵀ, then + W' φQ
    warpgroup::mm_ABt(dka, s.v[buf], s.state);
    warpgroup::mma_async_wait<1>(dva, kap, gt);
#pragma unroll
    for (int m = 0; m < DV_TILE / BASE; ++m)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int row = n + 8 * (k & 1);
        if (row < g.N)
          *reinterpret_cast<bf16_2*>(dv + int64_t(row) * g.dv_cols + BASE * m + base_col<row_layout>(k, 0)) =
              __floats2bfloat162_rn(g.scale * dva.tiles[0][m].data[k].x, g.scale * dva.tiles[0][m].data[k].y);
      }
    rt_bf<BASE, CHUNK> wt;  // W' = (G + dd_i) on and above the diagonal
    map_indexed(wt, gt, [&](int r, int col, float x) {
      return col >= row0 + r ? x + (NORM ? s.dd[col] : 0.f) : 0.f;
    });
    warpgroup::mma_AB(dka, wt, s.q[buf]);
    update_state<F>(state, s.q[buf], dn);  // R += φQᵀ dn
    rt_bf<BASE, F> kr;  // this warp's φk rows
    load(kr, s.k[buf], row0, 0);
    warpgroup::mma_async_wait<0>(dka, wt);
    hold_state<F>(state);
    const float one[2] = {1.f, 1.f};
    write_grad_rows<M, F>(g.dk_out ? g.dk_out + rows * F : nullptr, g.dk ? g.dk + rows * F : nullptr, n0, g.N, dka,
                          kr, g.scale, one, NORM ? s.r : nullptr);
    __syncthreads();  // every warp has read r, dn, dd and R's copy, and its wgmmas are done
    if constexpr (NORM) {
      if (vt == 0) add_column_sums<F>(s.r, s.q[buf], s.dd);
      __syncthreads();  // dd is read before the next chunk replaces it
    }
  }
}

}  // namespace
}  // namespace tk_linear_attention
