// Based linear attention, forward (linear_attention.h), on wgmma: a chunked causal scan whose state lives in one
// warpgroup's registers.
//
// One block (one warpgroup; two blocks per SM) per (batch·head, 64 value columns) walks the sequence in chunks of 64
// tokens. φ(q)·φ(k) = 1 + s + s²/2 (s = scale·q·k) has a constant, 16 linear and 256 quadratic features, so per chunk
//   o = [(1 + s + s²/2) ⊙ causal] v  +  Σ_prev v  +  (scale·q) A1  +  Σ_a (scale²/2 · q_a q) A2_a
//   A1 += kᵀ v,   A2_a += (k_a k)ᵀ v   (a = 0..15; 16 x 64 each),   Σ_prev v += Σ v
// with Q Kᵀ and every product on wgmma. A2's 256 features are four 64 x 64 fp32 accumulators (tile t: warp w's rows
// 16w + b are the features (a = 4t + w, b)); A1 is kept transposed (64 value columns x 16), the product Vᵀ K. Before
// each chunk the warps publish bf16 copies of A2 and A1ᵀ in shared memory, the B operands of the chunk's
// inter-chunk products. The φ tiles, the A operands, are built in registers from the 16-wide q and k rows: a column of
// q (a row of kᵀ) broadcast by shuffles, times the row, in bf16 pairs. Nothing of size 273 touches memory.
// The normaliser (normalize) is the same scan with v = 1: the intra-chunk weights' row sums, 64 per previous chunk,
// scale·q·K1 and (scale²/2) qᵀ Z q, with K1 = Σ_prev k and Z = Σ_prev k kᵀ, which every warp keeps itself (fp32,
// mma.sync; Z·q from Z's two bf16 halves).
// Loads are TMA, double-buffered (chunk c + 1 lands while chunk c is computed); rows past N read as zeros, and o
// leaves by TMA store from a staging tile, which drops them.
#include "based.cuh"

namespace tk_linear_attention {
namespace {

struct FwdGlobals {
  tma_map<RowsTile> q, k;
  tma_map<ValueTile> v, o;
  int H, N, tiles_v;
  float scale, eps;
};

struct FwdSmem {
  RowsTile q[2], k[2];
  ValueTile v[2];
  StateCopy state;             // bf16 copies of A2 and A1ᵀ before the current chunk
  ValueTile o;                 // the chunk's output on its way out
  float vsum[DV_TILE];         // Σ v over the previous chunks: the constant feature's state
  semaphore arrived[2];
};

__device__ __forceinline__ void load_chunk(FwdSmem& s, int buf, const FwdGlobals& g, int b, int h, int vt, int c) {
  semaphore& bar = s.arrived[buf];
  expect_bytes(bar, 2 * RowsTile::bytes + ValueTile::bytes);
  tma::load_async(s.q[buf], g.q, bar, {b, h, c, 0});
  tma::load_async(s.k[buf], g.k, bar, {b, h, c, 0});
  tma::load_async(s.v[buf], g.v, bar, {b, h, c, vt});
}

// One of the four A2 tiles: o += φq_T · A2_T (the copy before the chunk), A2_T += φk_Tᵀ v. At most two wgmma groups
// stay in flight: an A operand is rebuilt only after the group reading it has finished.
template <int T>
__device__ __forceinline__ void quad_step(rt_fl<BASE, DV_TILE>& o, rt_fl<BASE, DV_TILE>& acc, rt_bf<BASE, DV_TILE>& fq,
                                          rt_bf<BASE, CHUNK>& fk, const Frag& qs, const rt_bf<BASE, CHUNK>& kt,
                                          const FwdSmem& s, int buf, rt_bf<BASE, CHUNK>& p, rt_bf<BASE, DK>& ql) {
  quad_features_q<T>(fq, qs, std::make_integer_sequence<int, DV_TILE / BASE>{});
  warpgroup::mma_AB(o, fq, s.state.quad[T]);
  if constexpr (T == 0) warpgroup::mma_async_wait<1>(fk, p, ql);  // (the intra-chunk and linear products too)
  else warpgroup::mma_async_wait<1>(fk);
  quad_features_k<T>(fk, kt);
  warpgroup::mma_AB(acc, fk, s.v[buf]);
  warpgroup::mma_async_wait<1>(fq);
}

template <bool NORM>
__global__ void __launch_bounds__(WARPGROUP_THREADS, 2) based_fwd_kernel(const __grid_constant__ FwdGlobals g) {
  extern __shared__ uint8_t raw[];
  FwdSmem& s = *reinterpret_cast<FwdSmem*>(align_shared<1024>(raw));
  const int bh = blockIdx.x / g.tiles_v, vt = blockIdx.x % g.tiles_v, b = bh / g.H, h = bh % g.H;
  const int lane = laneid(), row0 = BASE * warpid();
  const int chunks = (g.N + CHUNK - 1) / CHUNK;
  const bool leader = threadIdx.x == 0;
  const float scale = g.scale;
  if (leader) {
    init_semaphore(s.arrived[0], 1);
    init_semaphore(s.arrived[1], 1);
    fence_semaphore_init();
    load_chunk(s, 0, g, b, h, vt, 0);
  }
  for (int i = threadIdx.x; i < DV_TILE; i += WARPGROUP_THREADS) s.vsum[i] = 0.f;
  rt_fl<BASE, DV_TILE> quad[QUAD_TILES];  // A2
  rt_fl<BASE, DK> lin;                   // A1ᵀ: warp w's rows are value columns 16w..16w + 15
  RowSums sums;                          // normalize: Z = Σ k kᵀ, K1 = Σ k over the previous chunks
#pragma unroll
  for (int t = 0; t < QUAD_TILES; ++t) zero(quad[t]);
  zero(lin);
  sums.clear();
  __syncthreads();

  for (int c = 0; c < chunks; ++c) {
    const int buf = c & 1;
    // The state before this chunk, in bf16 for the inter-chunk products (every warp waited for the previous chunk's
    // products before that chunk's closing barrier), and o's start: the constant feature's share, Σ_prev v.
    publish_state(s.state, quad, lin);
    rt_fl<BASE, DV_TILE> o;
    zero(o);
    map_indexed(o, o, [&](int, int col, float) { return s.vsum[col]; });
    if (leader) tma::store_read_wait<0>();  // the previous chunk's o has left the staging tile
    fence_async_shared();
    __syncthreads();  // the copies are visible to wgmma; every warp is done with chunk c - 1 and its buffers
    if (leader && c + 1 < chunks) load_chunk(s, buf ^ 1, g, b, h, vt, c + 1);
    wait(s.arrived[buf], (c >> 1) & 1);

    rt_fl<BASE, CHUNK> sc;  // q kᵀ, this warp's 16 rows
    warpgroup::mm_ABt(sc, s.q[buf], s.k[buf]);
    rt_bf<BASE, DK> qr, ql, qs;  // this warp's q rows: as read, times scale (linear features), times scale/√2
    load(qr, s.q[buf], row0, 0);
    warpgroup::mma_async_wait<0>(sc);
    float den[2] = {0.f, 0.f};  // normalize: this lane's share of its rows' sums (rows lane/4 and lane/4 + 8)
    rt_bf<BASE, CHUNK> p;       // intra-chunk weights 1 + x + x²/2 (x = scale·q·k) on and below the diagonal
    map_indexed(p, sc, [&](int r, int col, float qk) {
      const float x = scale * qk, w = col <= row0 + r ? 1.f + x + 0.5f * x * x : 0.f;
      if constexpr (NORM) den[r >> 3] += w;
      return w;
    });
    warpgroup::mma_AB(o, p, s.v[buf]);
    map_indexed(ql, qr, [&](int, int, float x) { return scale * x; });
    warpgroup::mma_ABt(o, ql, s.state.lin);
    map_indexed(qs, qr, [&](int, int, float x) { return 0.70710678f * scale * x; });
    rt_bf<CHUNK, DK, col_layout> kc;  // the chunk's k; its registers are kᵀ's (16 x 64) in row layout
    load(kc, s.k[buf]);
    const rt_bf<BASE, CHUNK>& kt = transposed(kc);

    rt_bf<BASE, DV_TILE> fq;
    rt_bf<BASE, CHUNK> fk;
    quad_step<0>(o, quad[0], fq, fk, qs.tiles[0][0], kt, s, buf, p, ql);
    quad_step<1>(o, quad[1], fq, fk, qs.tiles[0][0], kt, s, buf, p, ql);
    quad_step<2>(o, quad[2], fq, fk, qs.tiles[0][0], kt, s, buf, p, ql);
    quad_step<3>(o, quad[3], fq, fk, qs.tiles[0][0], kt, s, buf, p, ql);
    warpgroup::mma_AtB(lin, s.v[buf], s.k[buf]);  // A1ᵀ += vᵀ k

    if constexpr (NORM) {  // the previous chunks' share of the sums, then this chunk's keys join them
      rt_fl<BASE, DK> zq;
      float k1c[2][2];
      sums.product(zq, k1c, qr);
      normaliser_share(den, zq, k1c, qr, scale);
      sums.add(kc);
    }
    {  // Σ_prev v += this chunk's column sums (every warp read Σ_prev v before the barrier above)
      float2 acc = make_float2(0.f, 0.f);
#pragma unroll
      for (int r = 0; r < BASE; ++r) {
        const float2 pair = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(&s.v[buf](row0 + r, 2 * lane)));
        acc.x += pair.x, acc.y += pair.y;
      }
      atomicAdd(&s.vsum[2 * lane], acc.x);
      atomicAdd(&s.vsum[2 * lane + 1], acc.y);
    }
    warpgroup::mma_async_wait<0>(o, quad[3], lin, fk);

    float inv[2] = {1.f, 1.f};
    if constexpr (NORM)
#pragma unroll
      for (int i = 0; i < 2; ++i) inv[i] = 1.f / (quad_sum(den[i]) + float(CHUNK) * c + g.eps);
    rt_bf<BASE, DV_TILE> ob;
    map_indexed(ob, o, [&](int r, int, float x) { return x * inv[r >> 3]; });
    warpgroup::store(s.o, ob);
    fence_async_shared();
    __syncthreads();  // the staging tile is complete; Σ_prev v has this chunk's columns
    if (leader) {
      tma::store_async(g.o, s.o, {b, h, c, vt});
      tma::store_commit();
    }
  }
  if (leader) tma::store_wait<0>();
}

template <bool NORM>
const char* launch_fwd(const BasedArgs& a, cudaStream_t stream) {
  FwdGlobals g{};
  if (const char* e = make_input_maps<DK>(g, a)) return e;
  if (const char* e = make_tma_map(g.o, gl<bf16>(static_cast<bf16*>(a.o), a.B, a.H, a.N, a.dv))) return e;
  g.H = a.H, g.N = a.N, g.tiles_v = a.dv / DV_TILE, g.scale = a.scale, g.eps = a.eps;
  const size_t smem = sizeof(FwdSmem) + 1024;  // + the alignment of the dynamic shared memory base
  return launch_warpgroups(based_fwd_kernel<NORM>, int64_t(a.B) * a.H * g.tiles_v, smem, g, stream);
}

}  // namespace

const char* launch_based(const BasedArgs& a, cudaStream_t stream) {
  if (a.dv <= 0 || a.dv % VALUE_TILE != 0) return "dv must be a positive multiple of 64";
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  return a.normalize ? launch_fwd<true>(a, stream) : launch_fwd<false>(a, stream);
}

}  // namespace tk_linear_attention
