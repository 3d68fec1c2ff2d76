// Plain linear attention (identity, elu + 1), forward (linear_attention.h), on wgmma: a chunked causal scan whose
// state lives in one warpgroup's registers (plain.cuh has the design).
//
// Per chunk of 64 tokens, with H = Σ_prev φk vᵀ (dk x 64, the state) and z = Σ_prev φk:
//   o = scale [ (φQ φKᵀ ∘ causal) v + φQ H ]      [/ (scale (rowsum(φQ φKᵀ ∘ causal) + φQ z) + eps) when normalize]
//   H += φKᵀ v,   z += Σ φk
// The warps publish H's bf16 copy before each chunk (the B operand of φQ H); z is fp32 in shared memory, summed by
// column. Loads are TMA, double-buffered; rows past N read as zeros (their φk joins z only after the last chunk) and
// o's TMA store drops them.
#include "plain.cuh"

namespace tk_linear_attention {
namespace {

template <int F> struct FwdGlobals {
  tma_map<FeatTile<F>> q, k;
  tma_map<Block> v, o;
  int H, N, tiles_v;
  float scale, eps;
};

template <int F> struct FwdSmem {
  FeatTile<F> q[2], k[2];
  Block v[2];
  StateTile<F> state;  // H's bf16 copy before the current chunk
  Block o;             // the chunk's output on its way out
  float z[F];          // Σ φk over the previous chunks (normalize)
  semaphore arrived[2];
};

template <int F>
__device__ __forceinline__ void load_chunk(FwdSmem<F>& s, int buf, const FwdGlobals<F>& g, int b, int h, int vt, int c) {
  semaphore& bar = s.arrived[buf];
  expect_bytes(bar, 2 * FeatTile<F>::bytes + Block::bytes);
  tma::load_async(s.q[buf], g.q, bar, {b, h, c, 0});
  tma::load_async(s.k[buf], g.k, bar, {b, h, c, 0});
  tma::load_async(s.v[buf], g.v, bar, {b, h, c, vt});
}

template <int F, FeatureMap M, bool NORM>
__global__ void __launch_bounds__(WARPGROUP_THREADS, 2) plain_fwd_kernel(const __grid_constant__ FwdGlobals<F> g) {
  extern __shared__ uint8_t raw[];
  FwdSmem<F>& s = *reinterpret_cast<FwdSmem<F>*>(align_shared<1024>(raw));
  const ScanBlock at(g, blockIdx.x);
  const int b = at.b, h = at.h, vt = at.vt, chunks = at.chunks;
  const int row0 = BASE * warpid();
  const bool leader = threadIdx.x == 0;
  State<F> state;  // H
  start_scan<F>(s, state, [&] { load_chunk(s, 0, g, b, h, vt, 0); }, [&](int i) { s.z[i] = 0.f; });

  for (int c = 0; c < chunks; ++c) {
    const int buf = c & 1;
    wait(s.arrived[buf], (c >> 1) & 1);
    map_features<M>(s.q[buf], s.k[buf]);
    publish_state<F>(s.state, state);
    if (leader) tma::store_read_wait<0>();  // the previous chunk's o has left the staging tile
    fence_async_shared();
    __syncthreads();  // φq, φk and H's copy are visible to wgmma; every warp is done with chunk c - 1's buffers
    if (leader && c + 1 < chunks) load_chunk(s, buf ^ 1, g, b, h, vt, c + 1);

    rt_fl<BASE, CHUNK> sc;  // φq φkᵀ, this warp's 16 rows
    warpgroup::mm_ABt(sc, s.q[buf], s.k[buf]);
    rt_fl<BASE, DV_TILE> o;
    warpgroup::mm_AB(o, s.q[buf], s.state);  // φQ H
    float den[2] = {0.f, 0.f};               // normalize: this lane's share of its rows' sums (rows lane/4, lane/4 + 8)
    if constexpr (NORM) {
      rt_bf<BASE, F> qr;
      load(qr, s.q[buf], row0, 0);
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
    update_state<F>(state, s.k[buf], s.v[buf]);
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
    if constexpr (NORM) add_column_sums<F>(s.z, s.k[buf]);  // read next after the next chunk's first barrier
  }
  if (leader) tma::store_wait<0>();
}

template <int F, FeatureMap M>
const char* launch_fwd(const PlainArgs& a, cudaStream_t stream) {
  FwdGlobals<F> g{};
  if (const char* e = make_input_maps<F>(g, a)) return e;
  if (const char* e = make_tma_map(g.o, gl<bf16>(static_cast<bf16*>(a.o), a.B, a.H, a.N, a.dv))) return e;
  g.H = a.H, g.N = a.N, g.tiles_v = a.dv / DV_TILE, g.scale = a.scale, g.eps = a.eps;
  const size_t smem = sizeof(FwdSmem<F>) + 1024;  // + the alignment of the dynamic shared memory base
  const int64_t blocks = int64_t(a.B) * a.H * g.tiles_v;
  return a.normalize ? launch_warpgroups(plain_fwd_kernel<F, M, true>, blocks, smem, g, stream)
                     : launch_warpgroups(plain_fwd_kernel<F, M, false>, blocks, smem, g, stream);
}

}  // namespace

const char* launch_plain(const PlainArgs& a, cudaStream_t stream) {
  if (a.dv <= 0 || a.dv % DV_TILE != 0) return "dv must be a positive multiple of 64";
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  return dispatch_plain(a.features, a.map, [&]<int F, FeatureMap M>() { return launch_fwd<F, M>(a, stream); });
}

}  // namespace tk_linear_attention
