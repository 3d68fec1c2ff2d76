// VEC elements of T held as raw words, shared by both rotary kernels: element access is a shift or a register
// move (arrays of bf16 cost one register per element), and a pack moves in one VEC*sizeof(T)-byte access.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "rotary.h"

namespace tk_rotary {

template <typename T>
struct Type {
  using type = T;
};

constexpr int dtype_key(DType i, DType c, DType o) { return int(i) * 9 + int(c) * 3 + int(o); }

// Calls f(Type<TI>{}, Type<TC>{}, Type<TO>{}) with the element types of x, the tables and y, for the combinations
// supported() lists; cudaErrorInvalidValue for the others.
template <class F>
cudaError_t with_dtypes(const Args& a, F&& f) {
  using f32 = Type<float>;
  using f16 = Type<__half>;
  using bf16 = Type<__nv_bfloat16>;
  constexpr auto key = dtype_key;
  switch (key(a.in, a.tables, a.out)) {
    case key(DType::f32, DType::f32, DType::f32): return f(f32{}, f32{}, f32{});
    case key(DType::f16, DType::f16, DType::f16): return f(f16{}, f16{}, f16{});
    case key(DType::bf16, DType::bf16, DType::bf16): return f(bf16{}, bf16{}, bf16{});
    case key(DType::f16, DType::f32, DType::f32): return f(f16{}, f32{}, f32{});
    case key(DType::bf16, DType::f32, DType::f32): return f(bf16{}, f32{}, f32{});
    case key(DType::f16, DType::f32, DType::f16): return f(f16{}, f32{}, f16{});
    case key(DType::bf16, DType::f32, DType::bf16): return f(bf16{}, f32{}, bf16{});
    case key(DType::f32, DType::f32, DType::f16): return f(f32{}, f32{}, f16{});
    case key(DType::f32, DType::f32, DType::bf16): return f(f32{}, f32{}, bf16{});
    default: return cudaErrorInvalidValue;
  }
}

// The launchers are instantiated per x dtype, each in its own file (tile_<x>.cu, rows_<x>.cu), so that the build
// compiles them in parallel. with_x calls f(Type<X>{}) for x's dtype; with_x_dtypes is with_dtypes for the
// combinations whose x is TI (the others are not instantiated).
template <class F>
cudaError_t with_x(DType x, F&& f) {
  switch (x) {
    case DType::f32: return f(Type<float>{});
    case DType::f16: return f(Type<__half>{});
    case DType::bf16: return f(Type<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}
template <class TI, class F>
cudaError_t with_x_dtypes(const Args& a, F&& f) {
  return with_dtypes(a, [&](auto i, auto c, auto o) {
    if constexpr (std::is_same_v<typename decltype(i)::type, TI>) return f(i, c, o);
    else return cudaErrorInvalidValue;
  });
}

// The tile kernel (tile.cuh; cudaErrorNotSupported: a shape it does not cover) and the row kernel (rows.cuh).
template <class TI> cudaError_t launch_tile_x(const Args& args, cudaStream_t stream);
template <class TI> cudaError_t launch_rows_x(const Args& args, cudaStream_t stream);

inline int dtype_bytes(DType t) { return t == DType::f32 ? 4 : 2; }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Two floats rounded into one 32-bit word of 16-bit elements (one cvt instruction on sm_90).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

template <typename T, int VEC>
struct alignas(VEC * sizeof(T)) Pack {
  static constexpr int BYTES = VEC * int(sizeof(T));
  using Word = std::conditional_t<(BYTES % 4 == 0), uint32_t, uint16_t>;
  static constexpr int WORDS = BYTES / int(sizeof(Word));
  // Sign bits of every element of a word: negation without unpacking.
  static constexpr Word SIGNS = sizeof(T) == 4 ? Word(0x80000000u) : sizeof(Word) == 4 ? Word(0x80008000u) : Word(0x8000u);
  Word w[WORDS];

  __device__ __forceinline__ float get(int e) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[e]);
    } else if constexpr (sizeof(Word) == 2) {
      return std::is_same_v<T, __nv_bfloat16> ? __uint_as_float(uint32_t(w[0]) << 16) : __half2float(__ushort_as_half(w[0]));
    } else {
      const uint32_t word = w[e / 2];
      if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(e % 2 ? word & 0xffff0000u : word << 16);
      else return __half2float(__ushort_as_half(static_cast<unsigned short>(e % 2 ? word >> 16 : word & 0xffffu)));
    }
  }

  // Elements 2q and 2q+1 (VEC >= 2), so results can replace their inputs word by word.
  __device__ __forceinline__ void set_pair(int q, float lo, float hi) {
    if constexpr (sizeof(T) == 4) {
      w[2 * q] = __float_as_uint(lo), w[2 * q + 1] = __float_as_uint(hi);
    } else {
      static_assert(sizeof(Word) == 4, "pairs of 16-bit elements need VEC >= 2");
      w[q] = pack2<T>(lo, hi);
    }
  }

  // The only element (VEC == 1).
  __device__ __forceinline__ void set_one(float v) {
    if constexpr (sizeof(T) == 4) {
      w[0] = __float_as_uint(v);
    } else {
      const T t = from_float<T>(v);
      w[0] = *reinterpret_cast<const uint16_t*>(&t);
    }
  }

  // The same VEC elements from a pack of another (or the same) element type: rounded once.
  template <typename S>
  __device__ __forceinline__ void convert(const Pack<S, VEC>& src) {
    if constexpr (std::is_same_v<S, T>) {
#pragma unroll
      for (int i = 0; i < WORDS; ++i) w[i] = src.w[i];
    } else {
      float f[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = src.get(e);
      set(f);
    }
  }

  __device__ __forceinline__ void set(const float (&src)[VEC]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) w[e] = __float_as_uint(src[e]);
    } else if constexpr (sizeof(Word) == 2) {
      const T t = from_float<T>(src[0]);
      w[0] = *reinterpret_cast<const uint16_t*>(&t);
    } else {
#pragma unroll
      for (int i = 0; i < WORDS; ++i) w[i] = pack2<T>(src[2 * i], src[2 * i + 1]);
    }
  }
};

// One BYTES-wide access (two 16-byte ones for a 32-byte pack).
template <typename P>
__device__ __forceinline__ P load_pack(const void* src) {
  return *static_cast<const P*>(src);
}

template <typename P>
__device__ __forceinline__ void store_pack(void* dst, const P& p) {
  *static_cast<P*>(dst) = p;
}

}  // namespace tk_rotary
