// Per-vector row math and block-level helpers shared by the forward and the two backward kernels.
#pragma once
#include <type_traits>

#include "config.cuh"
#include "philox.cuh"

namespace tk_layernorm {

// h = residual + dropout(x) for the 8 elements at flat index `first`, rounded to H: the h that is stored
// and whose statistics eager would take. `res` is ignored unless has_res. (Packs go by value with flags,
// not as nullable pointers: a pointer into a register array puts the array in local memory.)
template <typename X, typename H>
__device__ __forceinline__ Pack8<H> make_h(const Pack8<X>& xp, const Pack8<H>& res, bool has_res, const Dropout& drop,
                                           bool dropout, uint64_t first) {
  float h[8];
  unpack(h, xp);
  if (dropout) {
    const uint32_t keep = drop.keep8(first);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = (keep >> i & 1u) ? __fmul_rn(h[i], drop.scale) : 0.f;
  }
  if (has_res) {
    float r[8];
    unpack(r, res);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = __fadd_rn(r[i], h[i]);
  }
  return pack<H>(h);
}

// 8 elements at element `at` of a tensor whose dtype is known only at run time (the gated norm's x and gate: any
// dtype, without an instantiation per dtype). The branch is uniform across the grid.
__device__ __forceinline__ void load8_as(float (&dst)[8], const void* base, DType t, int64_t at) {
  if (t == DType::f32) load8(dst, static_cast<const float*>(base) + at);
  else if (t == DType::bf16) load8(dst, static_cast<const __nv_bfloat16*>(base) + at);
  else load8(dst, static_cast<const __half*>(base) + at);
}

template <bool STREAM = false>
__device__ __forceinline__ void store8_as(void* base, DType t, int64_t at, const float (&src)[8]) {
  if (t == DType::f32) store8<float, STREAM>(static_cast<float*>(base) + at, src);
  else if (t == DType::bf16) store8<__nv_bfloat16, STREAM>(static_cast<__nv_bfloat16*>(base) + at, src);
  else store8<__half, STREAM>(static_cast<__half*>(base) + at, src);
}

// sigmoid(z) on the fast exponential and divide (within a few ulp of eager's fp32 silu). The gated backward
// takes two per element and was bound by them with an IEEE reciprocal (H200, 65536 x 2048: 0.73 ms against
// 0.52 ms with this one, forward 0.279 against 0.248 ms).
__device__ __forceinline__ float sigmoid(float z) { return __fdividef(1.f, 1.f + __expf(-z)); }

// h = x·silu(z) in fp32 (the gated norm), in place of x; s = sigmoid(z).
__device__ __forceinline__ void gate8(float (&x)[8], const float (&z)[8], float (&s)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    s[i] = sigmoid(z[i]);
    x[i] *= z[i] * s[i];
  }
}

__device__ __forceinline__ void gate8(float (&x)[8], const float (&z)[8]) {
  float s[8];
  gate8(x, z, s);
}

// y = (h - mean)·rstd·w + b for one vector (w, b used only when has_w, has_b).
template <typename H, typename W>
__device__ __forceinline__ void norm_vec(float (&out)[8], const Pack8<H>& hp, float mean, float rstd, const Pack8<W>& w,
                                         bool has_w, const Pack8<W>& b, bool has_b) {
  unpack(out, hp);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = (out[i] - mean) * rstd;
  if (has_w) {
    float wv[8];
    unpack(wv, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] *= wv[i];
  }
  if (has_b) {
    float bv[8];
    unpack(bv, b);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] += bv[i];
  }
}

// The w and b vectors of this thread's columns, into registers (left unset where absent or masked).
template <typename W, class S>
__device__ __forceinline__ void load_wb(Pack8<W> (&wr)[S::VECS], Pack8<W> (&br)[S::VECS], const W* w, const W* b,
                                        int lane, int nvec) {
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (vi < nvec) {
      if (w) wr[v] = load_pack(w + vi * 8);
      if (b) br[v] = load_pack(b + vi * 8);
    }
  }
}

// Two row sums for the price of one set of block syncs.
template <class S>
__device__ __forceinline__ float2 row_sum2(float a, float b, float2* smem /* [S::BLOCK / 32] */) {
  a = warp_sum(a);
  b = warp_sum(b);
  if constexpr (S::WARPS_PER_ROW == 1) {
    return make_float2(a, b);
  } else {
    __syncthreads();
    if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = make_float2(a, b);
    __syncthreads();
    const float2* mine = smem + (threadIdx.x / S::TPR) * S::WARPS_PER_ROW;
    float2 s = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < S::WARPS_PER_ROW; ++i) s = make_float2(s.x + mine[i].x, s.y + mine[i].y);
    return s;
  }
}

// dres (h's dtype) and dx (x's: through the regenerated dropout mask, or dres cast to x's dtype where the residual
// made h wider) of the vector at element base + vi * 8; a.dx is nullptr when dx is dres itself. STREAM: evict-first
// stores. DROPOUT = false: the caller knows a.dropout.enabled is false (and with one dtype for x and h, no dx code).
template <class Ty, bool STREAM = false, bool DROPOUT = true>
__device__ __forceinline__ void store_grads(const BackwardArgs& a, const Dropout& drop, int64_t base, int vi,
                                            const float (&dres)[8]) {
  using H = typename Ty::H;
  using X = typename Ty::X;
  store8<H, STREAM>(static_cast<H*>(a.dres) + base + vi * 8, dres);
  if constexpr (DROPOUT || !std::is_same_v<X, H>) {
    if (a.dx) {
      // dx sees dres rounded to H, as autograd through eager's dropout and add would.
      float dx[8];
      if (DROPOUT && a.dropout.enabled) {
        const uint32_t keep = drop.keep8(uint64_t(base) + uint64_t(vi) * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) dx[i] = (keep >> i & 1u) ? __fmul_rn(round_to<H>(dres[i]), drop.scale) : 0.f;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) dx[i] = round_to<H>(dres[i]);
      }
      store8<X, STREAM>(static_cast<X*>(a.dx) + base + vi * 8, dx);
    }
  }
}

// The backward of one vector from its normalised x̂ (xh), once the row sums are known:
// dres = rstd·(g − mean_g − x̂·mean_gx), plus the incoming dh (in dres on entry when add_dh), the dw/db
// partials, and dx through the regenerated dropout mask (STREAM, DROPOUT: store_grads').
// dres = rstd·(g − mean_g − x̂·mean_gx) (+ dres on entry when add_dh) and the dw/db partials, for one vector.
__device__ __forceinline__ void dnorm_vec(const float (&dy)[8], const float (&xh)[8], const float (&wv)[8], bool has_w,
                                          float (&dres)[8], bool add_dh, float rstd, float mean_g, float mean_gx,
                                          float (&acc_w)[8], float (&acc_b)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float g = has_w ? dy[i] * wv[i] : dy[i];
    const float dn = rstd * (g - mean_g - xh[i] * mean_gx);
    dres[i] = add_dh ? dres[i] + dn : dn;
    acc_w[i] += dy[i] * xh[i];
    acc_b[i] += dy[i];
  }
}

template <class Ty, bool STREAM = false, bool DROPOUT = true>
__device__ __forceinline__ void backward_vec_xhat(const BackwardArgs& a, const Dropout& drop, int64_t base, int vi,
                                                  const float (&dy)[8], const float (&xh)[8], const float (&wv)[8],
                                                  bool has_w, float (&dres)[8], bool add_dh, float rstd, float mean_g,
                                                  float mean_gx, float (&acc_w)[8], float (&acc_b)[8]) {
  dnorm_vec(dy, xh, wv, has_w, dres, add_dh, rstd, mean_g, mean_gx, acc_w, acc_b);
  store_grads<Ty, STREAM, DROPOUT>(a, drop, base, vi, dres);
}

// The gated norm's input gradients from dres = d loss / d h (h = x·silu(z), fp32; s = sigmoid(z)):
// dx = dres·z·s and dz = dres·x·s·(1 + z·(1 − s)), each in its tensor's dtype, at element `at`.
__device__ __forceinline__ void store_gate_grads(const BackwardArgs& a, int64_t at, const float (&dres)[8],
                                                 const float (&x)[8], const float (&z)[8], const float (&s)[8]) {
  float dx[8], dz[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    dx[i] = dres[i] * (z[i] * s[i]);
    dz[i] = dres[i] * x[i] * (s[i] * (1.f + z[i] * (1.f - s[i])));
  }
  store8_as(a.dx, a.dtypes.x, at, dx);
  store8_as(a.dgate, a.gate_dtype, at, dz);
}

// The same from h (in xh, normalised here in place). The vector starts at element base + vi * 8 of the
// (rows, hidden) tensors.
template <class Ty>
__device__ __forceinline__ void backward_vec(const BackwardArgs& a, const Dropout& drop, int64_t base, int vi, const float (&dy)[8],
                                             float (&xh)[8], const float (&wv)[8], bool has_w, float (&dres)[8],
                                             bool add_dh, float mean, float rstd, float mean_g, float mean_gx,
                                             float (&acc_w)[8], float (&acc_b)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) xh[i] = (xh[i] - mean) * rstd;
  backward_vec_xhat<Ty>(a, drop, base, vi, dy, xh, wv, has_w, dres, add_dh, rstd, mean_g, mean_gx, acc_w, acc_b);
}

// Sum the ROWS row-groups' accumulators of a block (sequentially, fixed order) and write the block's partial.
// Every thread of the block calls it.
template <class S>
__device__ __forceinline__ void write_partial(float (&acc)[S::VECS][8], float* out, int hidden,
                                              float* smem /* [S::MAX_HIDDEN] when ROWS > 1 */) {
  const int lane = threadIdx.x % S::TPR, group = threadIdx.x / S::TPR;
  const int nvec = hidden / 8;
  if constexpr (S::ROWS > 1) {
    for (int g = 0; g < S::ROWS; ++g) {
      if (group == g) {
#pragma unroll
        for (int v = 0; v < S::VECS; ++v)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            float& slot = smem[(v * S::TPR + lane) * 8 + i];
            slot = g == 0 ? acc[v][i] : slot + acc[v][i];
          }
      }
      __syncthreads();
    }
    if (group == 0) {
#pragma unroll
      for (int v = 0; v < S::VECS; ++v)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[v][i] = smem[(v * S::TPR + lane) * 8 + i];
    }
    __syncthreads();  // smem is reused for the next accumulator
  }
  if (group != 0) return;
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (vi < nvec) {
      float4* dst = reinterpret_cast<float4*>(out + vi * 8);
      dst[0] = make_float4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
      dst[1] = make_float4(acc[v][4], acc[v][5], acc[v][6], acc[v][7]);
    }
  }
}

}  // namespace tk_layernorm
