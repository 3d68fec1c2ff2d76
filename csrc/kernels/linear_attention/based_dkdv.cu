// Based linear attention, backward kernel B (based.cuh launch_based_dkdv): dk and dv, a reverse scan on wgmma, one
// warpgroup per (batch·head, 64 value columns), two blocks per SM.
//
// With dn = do/(d + eps) and dd = -(do·o)/(d + eps) (kernel A's 1/(d + eps); dn = do, dd = 0 without normalising),
// the state of the later chunks (the forward's with q and dn for k and v): R2 = Σ (q_a q)ᵀ dn, R1ᵀ = dnᵀ q, R0 = Σ dn,
// r2 = Σ dd q qᵀ, r1 = Σ dd q (README "Backward: the equations"):
//   dv_j = Σ_{i ≥ j, this chunk} κ_ij dn_i + R0 + scale·k_j R1 + Σ_a (scale²/2 · k_a k_j) R2_a
//   dk_j = scale Σ_{i ≥ j, this chunk} (v_j·dn_i + dd_i)(1 + s_ij) q_i
//        + scale² Σ_a k_j[a] (U_j[a, ·] + r2[a, ·]) + scale (v_j·R1 + r1),    U_j = v_j R2ᵀ (16 x 16)
// dv is the forward's product with the roles of q and k swapped (the causal side above the diagonal); dk is kernel
// A's with q and k, dn and v swapped. Per chunk, last to first: dn (and dd) into shared memory, then dv (stored),
// then dk with the state's update one R2 tile at a time. dk is linear in the value columns: each value tile adds its
// partial by fp32 atomics (dk is zeroed by the caller), the first with the dd terms.
#include "based.cuh"

namespace tk_linear_attention {
namespace {

struct DkdvGlobals {
  tma_map<RowsTile> q, k;
  tma_map<ValueTile> v, dout;
  const float* delta;  // (B·H, N) do·o per row, normalising only
  const float* inv;    // (B·H, N) 1/(d + eps) from kernel A, normalising only
  float* dk;           // (B·H, N, 16), fp32
  bf16* dv;            // (B·H, N, dv)
  int H, N, dv_cols, tiles_v;
  float scale;
};

struct DkdvSmem {
  RowsTile q[2], k[2];
  ValueTile v[2], dout[2];
  ValueTile dn;               // this chunk's dn
  StateCopy state;            // bf16 copies of R2 and R1ᵀ (the later chunks)
  float dd[CHUNK];            // this chunk's dd (zero past N, in value tiles after the first, without normalising)
  float rsum[2][DV_TILE];     // R0 before this chunk, and after it (written by column, read by the next chunk)
  semaphore arrived[2];
};

__device__ __forceinline__ void load_dkdv_chunk(DkdvSmem& s, int buf, const DkdvGlobals& g, int b, int h, int vt, int c) {
  semaphore& bar = s.arrived[buf];
  expect_bytes(bar, 2 * RowsTile::bytes + 2 * ValueTile::bytes);
  tma::load_async(s.q[buf], g.q, bar, {b, h, c, 0});
  tma::load_async(s.k[buf], g.k, bar, {b, h, c, 0});
  tma::load_async(s.v[buf], g.v, bar, {b, h, c, vt});
  tma::load_async(s.dout[buf], g.dout, bar, {b, h, c, vt});
}

template <bool NORM>
__global__ void __launch_bounds__(WARPGROUP_THREADS, 2) based_dkdv_kernel(const __grid_constant__ DkdvGlobals g) {
  extern __shared__ uint8_t raw[];
  DkdvSmem& s = *reinterpret_cast<DkdvSmem*>(align_shared<1024>(raw));
  const int bh = blockIdx.x / g.tiles_v, vt = blockIdx.x % g.tiles_v, b = bh / g.H, h = bh % g.H;
  const int lane = laneid(), warp = warpid(), row0 = BASE * warp;
  const int chunks = (g.N + CHUNK - 1) / CHUNK;
  const bool leader = threadIdx.x == 0;
  const float scale = g.scale, scale_sq = scale * scale;
  const float* delta = NORM ? g.delta + int64_t(bh) * g.N : nullptr;
  const float* inv = NORM ? g.inv + int64_t(bh) * g.N : nullptr;
  float* dk = g.dk + int64_t(bh) * g.N * DK;
  bf16* dv = g.dv + int64_t(bh) * g.N * g.dv_cols + vt * DV_TILE;
  if (leader) {
    init_semaphore(s.arrived[0], 1);
    init_semaphore(s.arrived[1], 1);
    fence_semaphore_init();
    load_dkdv_chunk(s, 0, g, b, h, vt, chunks - 1);
  }
  for (int i = threadIdx.x; i < DV_TILE; i += WARPGROUP_THREADS) s.rsum[0][i] = 0.f;
  rt_fl<BASE, DV_TILE> quad[QUAD_TILES];  // R2 (unscaled: Σ q_a q_b dn)
  rt_fl<BASE, DK> lin;                    // R1ᵀ (unscaled)
  RowSums dsums;                          // normalize, first value tile: r2 = Σ dd q qᵀ, r1 = Σ dd q
#pragma unroll
  for (int t = 0; t < QUAD_TILES; ++t) zero(quad[t]);
  zero(lin);
  dsums.clear();
  __syncthreads();

  for (int it = 0; it < chunks; ++it) {
    const int c = chunks - 1 - it, buf = it & 1, cur = it & 1;
    publish_state(s.state, quad, lin);
    // dn and dd: thread t takes row t / 2, columns 32 (t % 2) ..
    const int pr = threadIdx.x >> 1, ph = threadIdx.x & 1, pn = c * CHUNK + pr;
    float pinv = 1.f, pdd = 0.f;
    if constexpr (NORM) {
      pinv = pn < g.N ? inv[pn] : 0.f;
      pdd = vt == 0 && pn < g.N ? -delta[pn] * pinv : 0.f;
    }
    wait(s.arrived[buf], (it >> 1) & 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t off = ValueTile::offset(pr, 32 * ph + 8 * i);
      uint4 w = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(s.dout[buf].data) + off);
      bf16_2* p = reinterpret_cast<bf16_2*>(&w);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = __bfloat1622float2(p[e]);
        p[e] = __floats2bfloat162_rn(x.x * pinv, x.y * pinv);
      }
      *reinterpret_cast<uint4*>(reinterpret_cast<char*>(s.dn.data) + off) = w;
    }
    if (ph == 0) s.dd[pr] = pdd;
    fence_async_shared();
    __syncthreads();  // dn, dd and the state copies are visible; every warp is done with chunk c + 1
    if (leader && it + 1 < chunks) load_dkdv_chunk(s, buf ^ 1, g, b, h, vt, c - 1);

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
    warpgroup::mma_AB(dva, kap, s.dn);
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
    const int n0 = c * CHUNK + row0 + (lane >> 2);  // this lane's key rows: n0 and n0 + 8
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
    warpgroup::mm_ABt(gt, vr, s.dn);
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
    warpgroup::mma_AB(quad[0], fq, s.dn);
    warpgroup::mma_async_wait<1>(u);
    contract<0>(dkc, u, kr.tiles[0][0], scale_sq, std::make_integer_sequence<int, DV_TILE / BASE>{});
    grad_step<1>(dkc, quad[1], u, fq, vr, kr.tiles[0][0], s.q[buf], s.dn, s.state, scale_sq);
    grad_step<2>(dkc, quad[2], u, fq, vr, kr.tiles[0][0], s.q[buf], s.dn, s.state, scale_sq);
    grad_step<3>(dkc, quad[3], u, fq, vr, kr.tiles[0][0], s.q[buf], s.dn, s.state, scale_sq);
    warpgroup::mma_AtB(lin, s.dn, s.q[buf]);  // R1ᵀ += dnᵀ q
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
      for (int r = 0; r < CHUNK / 2; ++r) sum += __bfloat162float(s.dn(r0 + r, col));
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

template <bool NORM>
const char* launch_dkdv(const BasedBwdArgs& a, cudaStream_t stream) {
  DkdvGlobals g{};
  const auto view = [&](const void* p, int cols, const int64_t (&st)[3]) {
    return gl<bf16>(static_cast<bf16*>(const_cast<void*>(p)), a.B, a.H, a.N, cols, st[0], st[1], st[2]);
  };
  if (const char* e = make_tma_map(g.q, view(a.q, DK, a.q_stride))) return e;
  if (const char* e = make_tma_map(g.k, view(a.k, DK, a.k_stride))) return e;
  if (const char* e = make_tma_map(g.v, view(a.v, a.dv, a.v_stride))) return e;
  if (const char* e = make_tma_map(g.dout, gl<bf16>(static_cast<bf16*>(const_cast<void*>(a.dout)), a.B, a.H, a.N, a.dv)))
    return e;
  g.delta = a.delta, g.inv = a.inv, g.dk = a.dk, g.dv = static_cast<bf16*>(a.dv_out);
  g.H = a.H, g.N = a.N, g.dv_cols = a.dv, g.tiles_v = a.dv / DV_TILE, g.scale = a.scale;
  const int64_t blocks = int64_t(a.B) * a.H * g.tiles_v;
  if (blocks > 0x7fffffff) return "too many (batch, head, value tile) blocks for one launch";
  const size_t smem = sizeof(DkdvSmem) + 1024;  // + the alignment of the dynamic shared memory base
  const cudaError_t attr =
      cudaFuncSetAttribute(based_dkdv_kernel<NORM>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (attr != cudaSuccess) return cudaGetErrorString(attr);
  based_dkdv_kernel<NORM><<<unsigned(blocks), WARPGROUP_THREADS, smem, stream>>>(g);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* launch_based_dkdv(const BasedBwdArgs& a, cudaStream_t stream) {
  return a.normalize ? launch_dkdv<true>(a, stream) : launch_dkdv<false>(a, stream);
}

}  // namespace tk_linear_attention
