// Plain linear attention, forward (linear_attention.h), on wgmma: a chunked causal scan whose state lives in one
// warpgroup's registers (plain.cuh has the design). The elementwise maps' instances are in plain.cu, Hedgehog's in
// hedgehog.cu.
//
// Per chunk of 64 tokens, with H = Σ_prev φk vᵀ (F x 64, the state) and z = Σ_prev φk:
//   o = scale [ (φQ φKᵀ ∘ causal) v + φQ H ]      [/ (scale (rowsum(φQ φKᵀ ∘ causal) + φQ z) + eps) when normalize]
//   H += φKᵀ v,   z += Σ φk
// The warps publish H's bf16 copy before each chunk (the B operand of φQ H); z is fp32 in shared memory, summed by
// column. Loads are TMA, double-buffered (Hedgehog's W with the first chunk); rows past N read as zeros (their φk
// joins z only after the last chunk) and o's TMA store drops them.
#pragma once
#include "plain.cuh"

namespace tk_linear_attention {
namespace {

// F features from D input columns (D = F for the elementwise maps).
template <int F, int D> struct FwdGlobals {
  tma_map<st<bf16, CHUNK, D>> q, k;
  tma_map<Block> v, o;
  int H, N, tiles_v;
  float scale, eps;
  int weight_heads;                      // Hedgehog's: 1 (shared) or H
  tma_map<ProjectionTile<F, D>> wq, wk;  // Hedgehog's Wᵀ (unused by the elementwise maps)
};

// Hedgehog's W tiles and the chunk's φq, φk (the elementwise maps map the loaded tiles in place and need none).
// One buffer of φ: each chunk's are computed after the block's barrier that ends the previous chunk's reads.
template <int F, int D, FeatureMap M> struct Projections {};
template <int F, int D> struct Projections<F, D, FeatureMap::hedgehog> {
  ProjectionTile<F, D> wq, wk;
  FeatTile<F> q, k;
};

// The loaded q and k: double-buffered where they are the features (read through the chunk); Hedgehog reads them
// only for its map, before the barrier after which the next chunk's load is issued, so one buffer serves (and
// leaves room for two blocks per SM at dk 64 with 128 features).
template <FeatureMap M> constexpr int INPUT_BUFFERS = M == FeatureMap::hedgehog ? 1 : 2;

template <int F, int D, FeatureMap M> struct FwdSmem {
  st<bf16, CHUNK, D> q[INPUT_BUFFERS<M>], k[INPUT_BUFFERS<M>];
  Block v[2];
  StateTile<F> state;  // H's bf16 copy before the current chunk
  Block o;             // the chunk's output on its way out
  float z[F];          // Σ φk over the previous chunks (normalize)
  semaphore arrived[2];
  Projections<F, D, M> phi;
};

template <int F, int D, FeatureMap M>
__device__ __forceinline__ void load_chunk(FwdSmem<F, D, M>& s, int buf, const FwdGlobals<F, D>& g, int b, int h,
                                           int vt, int c) {
  semaphore& bar = s.arrived[buf];
  constexpr bool weights = M == FeatureMap::hedgehog;
  const bool first = weights && c == 0;
  expect_bytes(bar, 2 * st<bf16, CHUNK, D>::bytes + Block::bytes + (first ? 2 * ProjectionTile<F, D>::bytes : 0));
  if constexpr (weights)
    if (first) {
      const int hw = g.weight_heads == 1 ? 0 : h;
      tma::load_async(s.phi.wq, g.wq, bar, {0, hw, 0, 0});
      tma::load_async(s.phi.wk, g.wk, bar, {0, hw, 0, 0});
    }
  const int in = buf % INPUT_BUFFERS<M>;
  tma::load_async(s.q[in], g.q, bar, {b, h, c, 0});
  tma::load_async(s.k[in], g.k, bar, {b, h, c, 0});
  tma::load_async(s.v[buf], g.v, bar, {b, h, c, vt});
}

template <int F, int D, FeatureMap M, bool NORM>
__global__ void __launch_bounds__(WARPGROUP_THREADS, 2) plain_fwd_kernel(const __grid_constant__ FwdGlobals<F, D> g) {
  extern __shared__ uint8_t raw[];
  FwdSmem<F, D, M>& s = *reinterpret_cast<FwdSmem<F, D, M>*>(align_shared<1024>(raw));
  const ScanBlock at(g, blockIdx.x);
  const int b = at.b, h = at.h, vt = at.vt, chunks = at.chunks;
  const int row0 = BASE * warpid();
  const bool leader = threadIdx.x == 0;
  State<F> state;  // H
  start_scan<F>(s, state, [&] { load_chunk(s, 0, g, b, h, vt, 0); }, [&](int i) { s.z[i] = 0.f; });

  for (int c = 0; c < chunks; ++c) {
    const int buf = c & 1;
    wait(s.arrived[buf], (c >> 1) & 1);
    FeatTile<F>* fq;  // the chunk's φq and φk
    FeatTile<F>* fk;
    if constexpr (M == FeatureMap::hedgehog) {
      if constexpr (NORM) __syncthreads();  // every warp's column sums have read the previous chunk's φk
      hedgehog_features(s.phi.q, s.q[0], s.phi.wq);
      hedgehog_features(s.phi.k, s.k[0], s.phi.wk);
      fq = &s.phi.q, fk = &s.phi.k;
    } else {
      map_features<M>(s.q[buf], s.k[buf]);
      fq = &s.q[buf], fk = &s.k[buf];
    }
    publish_state<F>(s.state, state);
    if (leader) tma::store_read_wait<0>();  // the previous chunk's o has left the staging tile
    fence_async_shared();
    __syncthreads();  // φq, φk and H's copy are visible to wgmma; every warp is done with chunk c - 1's buffers
    if (leader && c + 1 < chunks) load_chunk(s, buf ^ 1, g, b, h, vt, c + 1);

    rt_fl<BASE, CHUNK> sc;  // φq φkᵀ, this warp's 16 rows
    warpgroup::mm_ABt(sc, *fq, *fk);
    rt_fl<BASE, DV_TILE> o;
    warpgroup::mm_AB(o, *fq, s.state);  // φQ H
    float den[2] = {0.f, 0.f};          // normalize: this lane's share of its rows' sums (rows lane/4, lane/4 + 8)
    if constexpr (NORM) {
      rt_bf<BASE, F> qr;
      load(qr, *fq, row0, 0);
      dot_rows<F>(den, qr, s.z);
    }
    warpgroup::mma_async_wait<1>(sc);
    rt_bf<BASE, CHUNK> p;  // the scores on and below the diagonal
    map_indexed(p, sc, [&](int r, int col, float x) {
      const float w = col <= row0 + r ? x : 0.f;
      if constexpr (NORM) den[r >> 3] += w;
      return w;
    });
    warpgroup::mma_AB(o, p, s.v[buf]);
    update_state<F>(state, *fk, s.v[buf]);
    warpgroup::mma_async_wait<0>(o, p);
    hold_state<F>(state);

    float f[2] = {g.scale, g.scale};
    if constexpr (NORM)
#pragma unroll
      for (int i = 0; i < 2; ++i) f[i] = g.scale / (g.scale * quad_sum(den[i]) + g.eps);
    rt_bf<BASE, DV_TILE> ob;
    map_indexed(ob, o, [&](int r, int, float x) { return x * f[r >> 3]; });
    warpgroup::store(s.o, ob);
    fence_async_shared();
    __syncthreads();  // the staging tile is complete; every warp has read z and the chunk's wgmmas are done
    if (leader) {
      tma::store_async(g.o, s.o, {b, h, c, vt});
      tma::store_commit();
    }
    if constexpr (NORM) add_column_sums<F>(s.z, *fk);  // read next after the next chunk's first barrier
  }
  if (leader) tma::store_wait<0>();
}

template <int F, int D, FeatureMap M>
const char* launch_fwd(const PlainArgs& a, cudaStream_t stream) {
  FwdGlobals<F, D> g{};
  if (const char* e = make_input_maps<D>(g, a)) return e;
  if (const char* e = make_tma_map(g.o, gl<bf16>(static_cast<bf16*>(a.o), a.B, a.H, a.N, a.dv))) return e;
  if constexpr (M == FeatureMap::hedgehog) {
    if (a.weight_heads != 1 && a.weight_heads != a.H) return "the Hedgehog weights must be per head or shared";
    const auto weights = [&](const void* w) {
      return gl<bf16>(static_cast<bf16*>(const_cast<void*>(w)), 1, a.weight_heads, F / 2, D);
    };
    if (const char* e = make_tma_map(g.wq, weights(a.q_weight_t))) return e;
    if (const char* e = make_tma_map(g.wk, weights(a.k_weight_t))) return e;
  }
  g.H = a.H, g.N = a.N, g.tiles_v = a.dv / DV_TILE, g.weight_heads = a.weight_heads, g.scale = a.scale, g.eps = a.eps;
  const size_t smem = sizeof(FwdSmem<F, D, M>) + 1024;  // + the alignment of the dynamic shared memory base
  const int64_t blocks = int64_t(a.B) * a.H * g.tiles_v;
  return a.normalize ? launch_warpgroups(plain_fwd_kernel<F, D, M, true>, blocks, smem, g, stream)
                     : launch_warpgroups(plain_fwd_kernel<F, D, M, false>, blocks, smem, g, stream);
}

// The checks every forward launch makes first; nullptr to go on (a.B·a.H·a.N == 0 sets `empty`).
inline const char* check_forward(const PlainArgs& a, bool& empty) {
  empty = a.B <= 0 || a.H <= 0 || a.N <= 0;
  return a.dv <= 0 || a.dv % DV_TILE != 0 ? "dv must be a positive multiple of 64" : nullptr;
}

}  // namespace
}  // namespace tk_linear_attention
