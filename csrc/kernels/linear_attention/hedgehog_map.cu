// Hedgehog's feature map as kernels of their own, for the backward (linear_attention.h): the backward kernels are the
// identity map's on the features (plain_backward.cu), so the features go in as a tensor and their gradient comes back
// as one. One warpgroup per (batch·head, chunk of 64 rows), the head's Wᵀ loaded by TMA with the chunk:
//   features:  φ = cat(p, n), p = softmax(x W), n = softmax(-x W)            (plain.cuh's hedgehog_features)
//   backward:  dz = p ∘ (dp - Σ dp∘p) - n ∘ (dn - Σ dn∘n)  for dφ = cat(dp, dn), the softmaxes recomputed from x;
//              dx = dz Wᵀ (wgmma, dz a register operand), and dz itself (the weight's gradient is Σ xᵀ dz over rows)
// Rows past N read as zeros (their dφ too, so their dz is zero) and the TMA stores drop them.
#include "plain.cuh"

namespace tk_linear_attention {
namespace {

template <int F, int D> struct MapGlobals {
  tma_map<st<bf16, CHUNK, D>> x, dx;
  tma_map<FeatTile<F>> features;  // φ out, or dφ in
  tma_map<st<bf16, CHUNK, F / 2>> dz;
  tma_map<ProjectionTile<F, D>> wt;
  int H, chunks, weight_heads;
};

template <int F, int D> struct MapSmem {
  st<bf16, CHUNK, D> x, dx;
  ProjectionTile<F, D> wt;
  FeatTile<F> features;
  st<bf16, CHUNK, F / 2> dz;
  semaphore arrived;
};

// The block's chunk and the head's Wᵀ (with dφ for the backward) on one semaphore; returns (b, h, chunk).
template <int F, int D, bool BACKWARD>
__device__ __forceinline__ coord load_map_chunk(MapSmem<F, D>& s, const MapGlobals<F, D>& g) {
  const int bh = blockIdx.x / g.chunks, c = blockIdx.x % g.chunks, b = bh / g.H, h = bh % g.H;
  if (threadIdx.x == 0) {
    init_semaphore(s.arrived, 1);
    fence_semaphore_init();
    expect_bytes(s.arrived, st<bf16, CHUNK, D>::bytes + ProjectionTile<F, D>::bytes +
                                (BACKWARD ? FeatTile<F>::bytes : 0));
    tma::load_async(s.x, g.x, s.arrived, {b, h, c, 0});
    tma::load_async(s.wt, g.wt, s.arrived, {0, g.weight_heads == 1 ? 0 : h, 0, 0});
    if constexpr (BACKWARD) tma::load_async(s.features, g.features, s.arrived, {b, h, c, 0});
  }
  __syncthreads();  // the semaphore is initialised
  wait(s.arrived, 0);
  return {b, h, c, 0};
}

template <int F, int D>
__global__ void __launch_bounds__(WARPGROUP_THREADS) hedgehog_map_kernel(const __grid_constant__ MapGlobals<F, D> g) {
  extern __shared__ uint8_t raw[];
  MapSmem<F, D>& s = *reinterpret_cast<MapSmem<F, D>*>(align_shared<1024>(raw));
  const coord at = load_map_chunk<F, D, false>(s, g);
  hedgehog_features(s.features, s.x, s.wt);
  fence_async_shared();
  __syncthreads();  // φ is complete
  if (threadIdx.x == 0) {
    tma::store_async(g.features, s.features, at);
    tma::store_commit();
    tma::store_wait<0>();
  }
}

template <int F, int D>
__global__ void __launch_bounds__(WARPGROUP_THREADS) hedgehog_map_bwd_kernel(const __grid_constant__ MapGlobals<F, D> g) {
  extern __shared__ uint8_t raw[];
  MapSmem<F, D>& s = *reinterpret_cast<MapSmem<F, D>*>(align_shared<1024>(raw));
  const coord at = load_map_chunk<F, D, true>(s, g);
  Projected<F> p, n, dp, dn;
  hedgehog_softmaxes<F>(p, n, s.x, s.wt);
  {
    rt_bf<BASE, F / 2> half;  // this warp's rows of dφ's two halves
    load(half, s.features, BASE * warpid(), 0);
    copy(dp, half);
    load(half, s.features, BASE * warpid(), F / 2);
    copy(dn, half);
  }
  row_vec<Projected<F>, float> dot;
  Projected<F> t;
  mul(t, dp, p);  // dp ← p ∘ (dp - Σ dp∘p), the softmax's Jacobian
  row_sum(dot, t);
  sub_row(dp, dp, dot);
  mul(dp, dp, p);
  mul(t, dn, n);  // and n's, entered with -z
  row_sum(dot, t);
  sub_row(dn, dn, dot);
  mul(dn, dn, n);
  sub(dp, dp, dn);
  rt_bf<BASE, F / 2> dz;
  copy(dz, dp);
  rt_fl<BASE, D> dx;
  warpgroup::mm_AB(dx, dz, s.wt);
  warpgroup::store(s.dz, dz);
  warpgroup::mma_async_wait<0>(dx, dz);
  rt_bf<BASE, D> dxb;
  copy(dxb, dx);
  warpgroup::store(s.dx, dxb);
  fence_async_shared();
  __syncthreads();  // dx and dz are complete
  if (threadIdx.x == 0) {
    tma::store_async(g.dx, s.dx, at);
    tma::store_async(g.dz, s.dz, at);
    tma::store_commit();
    tma::store_wait<0>();
  }
}

template <int F, int D, bool BACKWARD> const char* launch_map(const HedgehogMapArgs& a, cudaStream_t stream) {
  MapGlobals<F, D> g{};
  const auto view = [&](const void* p, int cols) {
    return gl<bf16>(static_cast<bf16*>(const_cast<void*>(p)), a.B, a.H, a.N, cols);
  };
  const gl<bf16> x(static_cast<bf16*>(const_cast<void*>(a.x)), a.B, a.H, a.N, D, a.x_stride[0], a.x_stride[1],
                   a.x_stride[2]);
  if (const char* e = make_tma_map(g.x, x)) return e;
  if (const char* e = make_tma_map(g.features, view(a.features, F))) return e;
  if (const char* e = make_tma_map(g.wt, gl<bf16>(static_cast<bf16*>(const_cast<void*>(a.weight_t)), 1, a.weight_heads,
                                                  F / 2, D)))
    return e;
  if constexpr (BACKWARD) {
    if (const char* e = make_tma_map(g.dx, view(a.dx, D))) return e;
    if (const char* e = make_tma_map(g.dz, view(a.dz, F / 2))) return e;
  }
  g.H = a.H, g.chunks = (a.N + CHUNK - 1) / CHUNK, g.weight_heads = a.weight_heads;
  const size_t smem = sizeof(MapSmem<F, D>) + 1024;  // + alignment
  const int64_t blocks = int64_t(a.B) * a.H * g.chunks;
  if constexpr (BACKWARD) return launch_warpgroups(hedgehog_map_bwd_kernel<F, D>, blocks, smem, g, stream);
  else return launch_warpgroups(hedgehog_map_kernel<F, D>, blocks, smem, g, stream);
}

template <bool BACKWARD> const char* dispatch_map(const HedgehogMapArgs& a, cudaStream_t stream) {
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  if (a.weight_heads != 1 && a.weight_heads != a.H) return "the Hedgehog weights must be per head or shared";
  return dispatch_hedgehog(a.dk, a.F, [&]<int F, int D>() { return launch_map<F, D, BACKWARD>(a, stream); });
}

}  // namespace

const char* launch_hedgehog_features(const HedgehogMapArgs& a, cudaStream_t stream) {
  return dispatch_map<false>(a, stream);
}
const char* launch_hedgehog_features_backward(const HedgehogMapArgs& a, cudaStream_t stream) {
  return dispatch_map<true>(a, stream);
}

}  // namespace tk_linear_attention
