// Wide global loads/stores of 8 consecutive elements and fp32 conversions, for memory-bound row kernels.
// 8 elements = one 16-byte access for bf16/fp16 and two for fp32, so every warp access is fully coalesced.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>
#include <tk/common.cuh>

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

// 8 elements of T as raw 32-bit words (4 for 16-bit types, 8 for fp32). Raw words keep the
// conversions to plain register moves/shifts (struct-of-bf16 copies made ptxas spill).
template <typename T>
struct alignas(8 * sizeof(T)) Pack8 {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "Pack8 holds 16- or 32-bit elements");
  uint32_t w[2 * sizeof(T)];
};

// Read-only data (inputs of a kernel) goes through the non-coherent path.
template <typename T>
__device__ __forceinline__ Pack8<T> load_pack(const T* src) {
  Pack8<T> p;
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < int(sizeof(T)) / 2; ++i) {
    const uint4 q = __ldg(s + i);
    p.w[4 * i] = q.x, p.w[4 * i + 1] = q.y, p.w[4 * i + 2] = q.z, p.w[4 * i + 3] = q.w;
  }
  return p;
}

// STREAM: st.global.cs, evict-first in L2 (an output nothing in the kernel reads again).
template <typename T, bool STREAM = false>
__device__ __forceinline__ void store_pack(T* dst, const Pack8<T>& p) {
  uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < int(sizeof(T)) / 2; ++i) {
    const uint4 q = make_uint4(p.w[4 * i], p.w[4 * i + 1], p.w[4 * i + 2], p.w[4 * i + 3]);
    if constexpr (STREAM) __stcs(d + i, q);
    else d[i] = q;
  }
}

template <typename T>
__device__ __forceinline__ void unpack(float (&dst)[8], const Pack8<T>& p) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      dst[2 * i] = __uint_as_float(p.w[2 * i]);
      dst[2 * i + 1] = __uint_as_float(p.w[2 * i + 1]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // bf16 -> fp32 is a shift
      dst[2 * i] = __uint_as_float(p.w[i] << 16);
      dst[2 * i + 1] = __uint_as_float(p.w[i] & 0xffff0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&p.w[i]));
      dst[2 * i] = f.x;
      dst[2 * i + 1] = f.y;
    }
  }
}

template <typename T>
__device__ __forceinline__ Pack8<T> pack(const float (&src)[8]) {
  Pack8<T> p;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      p.w[2 * i] = __float_as_uint(src[2 * i]);
      p.w[2 * i + 1] = __float_as_uint(src[2 * i + 1]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(src[2 * i], src[2 * i + 1]);
      p.w[i] = *reinterpret_cast<const uint32_t*>(&h);
    } else {
      const __half2 h = __floats2half2_rn(src[2 * i], src[2 * i + 1]);
      p.w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  return p;
}

template <typename T>
__device__ __forceinline__ void load8(float (&dst)[8], const T* src) {
  unpack(dst, load_pack(src));
}

template <typename T, bool STREAM = false>
__device__ __forceinline__ void store8(T* dst, const float (&src)[8]) {
  store_pack<T, STREAM>(dst, pack<T>(src));
}

using tk::warp_sum;

}  // namespace tk_layernorm
