// Wide global loads/stores of 8 consecutive elements and fp32 conversions, for memory-bound row kernels.
// 8 elements = one 16-byte access for bf16/fp16 and two for fp32, so every warp access is fully coalesced.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace tk_layernorm {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Round through T and back: the value a T tensor would hold (identity for fp32).
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

template <typename T>
struct alignas(8 * sizeof(T)) Pack8 {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "Pack8 holds 16- or 32-bit elements");
  T v[8];
};

// Read-only data (inputs of a kernel) goes through the non-coherent path.
template <typename T>
__device__ __forceinline__ Pack8<T> load_pack(const T* src) {
  Pack8<T> p;
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint4*>(&p) = __ldg(reinterpret_cast<const uint4*>(src));
  } else {
    reinterpret_cast<float4*>(&p)[0] = __ldg(reinterpret_cast<const float4*>(src));
    reinterpret_cast<float4*>(&p)[1] = __ldg(reinterpret_cast<const float4*>(src) + 1);
  }
  return p;
}

template <typename T>
__device__ __forceinline__ void unpack(float (&dst)[8], const Pack8<T>& p) {
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = to_float(p.v[i]);
}

template <typename T>
__device__ __forceinline__ void load8(float (&dst)[8], const T* src) {
  unpack(dst, load_pack(src));
}

template <typename T>
__device__ __forceinline__ void store8(T* dst, const float (&src)[8]) {
  Pack8<T> p;
#pragma unroll
  for (int i = 0; i < 8; ++i) p.v[i] = from_float<T>(src[i]);
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&p);
  } else {
    reinterpret_cast<float4*>(dst)[0] = reinterpret_cast<const float4*>(&p)[0];
    reinterpret_cast<float4*>(dst)[1] = reinterpret_cast<const float4*>(&p)[1];
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace tk_layernorm
