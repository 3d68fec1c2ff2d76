// Rotary embedding: one thread per unit of VEC channels (NeoX: VEC channels of each half, so the
// partner is in registers; interleaved: VEC/2 pairs; pass-through: VEC channels copied). Loads and
// stores are VEC-wide (16 bytes for 16-bit types at VEC 8); VEC is the widest that every pointer,
// stride and size allows, so odd layouts still run (narrower), never a skipped tail.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "rotary.h"

namespace tk_rotary {
namespace {

constexpr int kBlock = 256;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int VEC>
struct alignas(VEC * sizeof(T)) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load(float (&dst)[VEC], const T* src) {
  const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(src);
#pragma unroll
  for (int i = 0; i < VEC; ++i) dst[i] = to_float(p.v[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* dst, const float (&src)[VEC]) {
  Pack<T, VEC> p;
#pragma unroll
  for (int i = 0; i < VEC; ++i) p.v[i] = from_float<T>(src[i]);
  *reinterpret_cast<Pack<T, VEC>*>(dst) = p;
}

template <typename T, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kBlock) rotary_kernel(Args a, unsigned blocks0) {
  const Operand& op = blockIdx.x < blocks0 ? a.ops[0] : a.ops[1];
  const int64_t item = int64_t(blockIdx.x < blocks0 ? blockIdx.x : blockIdx.x - blocks0) * kBlock + threadIdx.x;
  const int rot_units = INTERLEAVED ? a.rotary_dim / VEC : a.rotary_dim / 2 / VEC;
  const int units = rot_units + (a.head_dim - a.rotary_dim) / VEC;
  const int64_t rows = op.shape[0] * op.shape[1] * op.shape[2];
  if (item >= rows * units) return;
  // Index math in 32 bits when it fits (it almost always does): 64-bit division is a long software sequence.
  int64_t n, h, b;
  int u;
  if (rows * units <= 0xffffffffLL) {
    const uint32_t it = uint32_t(item), r = it / uint32_t(units), bh = r / uint32_t(op.shape[2]);
    u = int(it - r * uint32_t(units));
    n = r - bh * uint32_t(op.shape[2]);
    b = bh / uint32_t(op.shape[1]);
    h = bh - uint32_t(b) * uint32_t(op.shape[1]);
  } else {
    const int64_t row = item / units;
    u = int(item - row * units);
    n = row % op.shape[2];
    const int64_t bh = row / op.shape[2];
    h = bh % op.shape[1];
    b = bh / op.shape[1];
  }
  const T* in = static_cast<const T*>(op.in) + b * op.in_stride[0] + h * op.in_stride[1] + n * op.in_stride[2];
  T* out = static_cast<T*>(op.out) + b * op.out_stride[0] + h * op.out_stride[1] + n * op.out_stride[2];

  if (u >= rot_units) {  // pass-through channels
    const int j = a.rotary_dim + (u - rot_units) * VEC;
    float x[VEC];
    load<T, VEC>(x, in + j);
    store<T, VEC>(out + j, x);
    return;
  }
  const int64_t cs = b * op.cs_stride[0] + h * op.cs_stride[1] + n * op.cs_stride[2];
  const T* cosp = static_cast<const T*>(op.cos) + cs;
  const T* sinp = static_cast<const T*>(op.sin) + cs;
  // Forward:  y[j] = x[j]·c[j] + sgn[j]·x[p(j)]·s[j]
  // Backward: y[j] = x[j]·c[j] - sgn[j]·x[p(j)]·s[p(j)]   (the transposed rotation)
  // with partner p(j) and sgn[j] = -1 on the first of each pair (first half / even channel), +1 on the second.
  const float dir = a.backward ? -1.f : 1.f;
  if constexpr (INTERLEAVED) {
    const int j = u * VEC;
    float x[VEC], c[VEC], s[VEC], y[VEC];
    load<T, VEC>(x, in + j);
    load<T, VEC>(c, cosp + j);
    load<T, VEC>(s, sinp + j);
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      const float s0 = a.backward ? s[i + 1] : s[i];
      const float s1 = a.backward ? s[i] : s[i + 1];
      y[i] = x[i] * c[i] - dir * x[i + 1] * s0;
      y[i + 1] = x[i + 1] * c[i + 1] + dir * x[i] * s1;
    }
    store<T, VEC>(out + j, y);
  } else {
    const int half = a.rotary_dim / 2;
    const int j = u * VEC;
    float x1[VEC], x2[VEC], c1[VEC], c2[VEC], s1[VEC], s2[VEC], y1[VEC], y2[VEC];
    load<T, VEC>(x1, in + j);
    load<T, VEC>(x2, in + half + j);
    load<T, VEC>(c1, cosp + j);
    load<T, VEC>(c2, cosp + half + j);
    load<T, VEC>(s1, sinp + j);
    load<T, VEC>(s2, sinp + half + j);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float sa = a.backward ? s2[i] : s1[i];
      const float sb = a.backward ? s1[i] : s2[i];
      y1[i] = x1[i] * c1[i] - dir * x2[i] * sa;
      y2[i] = x2[i] * c2[i] + dir * x1[i] * sb;
    }
    store<T, VEC>(out + j, y1);
    store<T, VEC>(out + half + j, y2);
  }
}

bool divisible(const Args& a, int vec, int elem_bytes) {
  const int64_t align = int64_t(vec) * elem_bytes;
  if (a.head_dim % vec || a.rotary_dim % vec) return false;
  if (!a.interleaved && (a.rotary_dim / 2) % vec) return false;
  for (int i = 0; i < a.count; ++i) {
    const Operand& o = a.ops[i];
    for (const void* p : {static_cast<const void*>(o.out), o.in, o.cos, o.sin})
      if (reinterpret_cast<uintptr_t>(p) % align) return false;
    for (int d = 0; d < 3; ++d)
      if (o.in_stride[d] % vec || o.out_stride[d] % vec || o.cs_stride[d] % vec) return false;
  }
  return true;
}

template <typename T, int VEC>
cudaError_t run(const Args& a, cudaStream_t stream) {
  int64_t blocks[2] = {0, 0};
  const int units = (a.interleaved ? a.rotary_dim / VEC : a.rotary_dim / 2 / VEC) + (a.head_dim - a.rotary_dim) / VEC;
  for (int i = 0; i < a.count; ++i) {
    const int64_t rows = a.ops[i].shape[0] * a.ops[i].shape[1] * a.ops[i].shape[2];
    blocks[i] = (rows * units + kBlock - 1) / kBlock;
  }
  const int64_t total = blocks[0] + blocks[1];
  if (total == 0) return cudaSuccess;
  if (total > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (a.interleaved)
    rotary_kernel<T, VEC, true><<<unsigned(total), kBlock, 0, stream>>>(a, unsigned(blocks[0]));
  else
    rotary_kernel<T, VEC, false><<<unsigned(total), kBlock, 0, stream>>>(a, unsigned(blocks[0]));
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_vec(const Args& a, cudaStream_t stream) {
  if (divisible(a, 8, sizeof(T))) return run<T, 8>(a, stream);
  if (divisible(a, 2, sizeof(T))) return run<T, 2>(a, stream);
  if (!a.interleaved && divisible(a, 1, sizeof(T))) return run<T, 1>(a, stream);
  return cudaErrorInvalidValue;  // interleaved pairs need even sizes and strides
}

}  // namespace

cudaError_t launch(const Args& args, DType dtype, cudaStream_t stream) {
  if (args.count < 1 || args.count > 2 || args.rotary_dim <= 0 || args.rotary_dim % 2 || args.rotary_dim > args.head_dim)
    return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::f32: return dispatch_vec<float>(args, stream);
    case DType::f16: return dispatch_vec<__half>(args, stream);
    case DType::bf16: return dispatch_vec<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tk_rotary
