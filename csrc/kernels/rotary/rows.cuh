// Rotary embedding, row kernel (the tile kernel's fallback, rotary.h), instantiated per x dtype in rows_<x>.cu.
// One thread per (batch, position, unit of VEC channels), walking the heads (NeoX: VEC
// channels of each half, so the partner is in registers; interleaved: VEC/2 pairs; pass-through: copied). Loads and
// stores are VEC-wide (16 bytes for 16-bit types at VEC 8); VEC is the widest that every pointer,
// stride and size allows, so odd layouts still run (narrower), never a skipped tail.
#pragma once
#include <cstdint>

#include "pack.cuh"
#include "rotary.h"

namespace tk_rotary {
namespace {

constexpr int kBlock = 256;

template <typename T, int VEC>
__device__ __forceinline__ void store(T* dst, const float (&src)[VEC]) {
  Pack<T, VEC> p;
  p.set(src);
  store_pack(dst, p);
}

// One thread per (b, n, unit); it walks the heads, so cos/sin (shared by the heads) are read once per
// thread instead of once per head: otherwise their L2 traffic is twice the tensors' own. Heads go in
// batches of HEADS whose loads are all issued before any store (stores could alias the inputs as far
// as the compiler knows, which would serialise the loads).
// 64 bytes of loads in flight per thread either way: NeoX loads both halves of each head.
template <bool INTERLEAVED>
constexpr int kHeads = INTERLEAVED ? 4 : 2;

// 4 blocks per SM at least (<= 64 registers; 2 with fp32 data): 1024 threads, each with 64 bytes of loads in flight.
template <typename TI, typename TC, typename TO, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kBlock, (sizeof(TI) == 4 || sizeof(TC) == 4) ? 2 : 4) rows_kernel(Args a, unsigned blocks0) {
  const Operand& op = blockIdx.x < blocks0 ? a.ops[0] : a.ops[1];
  const int64_t item = int64_t(blockIdx.x < blocks0 ? blockIdx.x : blockIdx.x - blocks0) * kBlock + threadIdx.x;
  const int rot_units = INTERLEAVED ? a.rotary_dim / VEC : a.rotary_dim / 2 / VEC;
  const int units = rot_units + (a.head_dim - a.rotary_dim) / VEC;
  const int64_t B = op.shape[0], H = op.shape[1], N = op.shape[2];
  if (item >= B * N * units) return;
  // Index math in 32 bits when it fits (it almost always does): 64-bit division is a long sequence.
  int64_t n, b;
  int u;
  if (B * N * units <= 0xffffffffLL) {
    const uint32_t it = uint32_t(item), bn = it / uint32_t(units);
    u = int(it - bn * uint32_t(units));
    b = bn / uint32_t(N);
    n = bn - uint32_t(b) * uint32_t(N);
  } else {
    const int64_t bn = item / units;
    u = int(item - bn * units);
    b = bn / N;
    n = bn - b * N;
  }
  const TI* in = static_cast<const TI*>(op.in) + b * op.in_stride[0] + n * op.in_stride[2];
  TO* out = static_cast<TO*>(op.out) + b * op.out_stride[0] + n * op.out_stride[2];
  const int64_t ish = op.in_stride[1], osh = op.out_stride[1];
  constexpr int HEADS = kHeads<INTERLEAVED>;

  if (u >= rot_units) {  // pass-through channels: copied
    const int j = a.rotary_dim + (u - rot_units) * VEC;
    for (int64_t h0 = 0; h0 < H; h0 += HEADS) {
      Pack<TI, VEC> x[HEADS];
#pragma unroll
      for (int i = 0; i < HEADS; ++i)
        if (h0 + i < H) x[i] = load_pack<Pack<TI, VEC>>(in + (h0 + i) * ish + j);
#pragma unroll
      for (int i = 0; i < HEADS; ++i) {
        if (h0 + i >= H) continue;
        Pack<TO, VEC> y;
        y.convert(x[i]);
        store_pack(out + (h0 + i) * osh + j, y);
      }
    }
    return;
  }
  const TC* cosp = static_cast<const TC*>(op.cos) + b * op.cs_stride[0] + n * op.cs_stride[2];
  const TC* sinp = static_cast<const TC*>(op.sin) + b * op.cs_stride[0] + n * op.cs_stride[2];
  // Forward:  y[j] = x[j]·c[j] + sgn[j]·x[p(j)]·s[j]
  // Backward: y[j] = x[j]·c[j] - sgn[j]·x[p(j)]·s[p(j)]   (the transposed rotation)
  // with partner p(j) and sgn[j] = -1 on the first of each pair (first half / even channel), +1 on the second.
  const float dir = a.backward ? -1.f : 1.f;
  const int j = u * VEC;
  const int partner = INTERLEAVED ? 0 : a.rotary_dim / 2;  // offset of the second operand of a pair
  // Tables for this (b, n): loaded once unless they vary over heads (stride != 0).
  Pack<TC, VEC> c1, c2, s1, s2;
  auto load_tables = [&](int64_t h) {
    const int64_t o = h * op.cs_stride[1];
    c1 = load_pack<Pack<TC, VEC>>(cosp + o + j);
    s1 = load_pack<Pack<TC, VEC>>(sinp + o + j);
    if constexpr (!INTERLEAVED) {
      c2 = load_pack<Pack<TC, VEC>>(cosp + o + partner + j);
      s2 = load_pack<Pack<TC, VEC>>(sinp + o + partner + j);
    }
  };
  const bool per_head_tables = op.cs_stride[1] != 0;
  if (!per_head_tables) load_tables(0);
  for (int64_t h0 = 0; h0 < H; h0 += HEADS) {
    Pack<TI, VEC> xa[HEADS], xb[HEADS];
#pragma unroll
    for (int i = 0; i < HEADS; ++i) {
      if (h0 + i < H) {
        xa[i] = load_pack<Pack<TI, VEC>>(in + (h0 + i) * ish + j);
        if constexpr (!INTERLEAVED) xb[i] = load_pack<Pack<TI, VEC>>(in + (h0 + i) * ish + partner + j);
      }
    }
#pragma unroll
    for (int i = 0; i < HEADS; ++i) {
      if (h0 + i >= H) continue;
      if (per_head_tables) load_tables(h0 + i);
      TO* o = out + (h0 + i) * osh;
      if constexpr (INTERLEAVED) {
        float x[VEC], y[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) x[e] = xa[i].get(e);
#pragma unroll
        for (int e = 0; e < VEC; e += 2) {
          const float se = s1.get(e), so = s1.get(e + 1);  // constant indices: registers, not local memory
          const float s0 = a.backward ? so : se;
          const float s_1 = a.backward ? se : so;
          y[e] = x[e] * c1.get(e) - dir * x[e + 1] * s0;
          y[e + 1] = x[e + 1] * c1.get(e + 1) + dir * x[e] * s_1;
        }
        store<TO, VEC>(o + j, y);
      } else {
        float y1[VEC], y2[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float x1 = xa[i].get(e), x2 = xb[i].get(e);
          const float sa = a.backward ? s2.get(e) : s1.get(e);
          const float sb = a.backward ? s1.get(e) : s2.get(e);
          y1[e] = x1 * c1.get(e) - dir * x2 * sa;
          y2[e] = x2 * c2.get(e) + dir * x1 * sb;
        }
        store<TO, VEC>(o + j, y1);
        store<TO, VEC>(o + partner + j, y2);
      }
    }
  }
}

template <typename TI, typename TC, typename TO, int VEC>
cudaError_t run(const Args& a, cudaStream_t stream) {
  int64_t blocks[2] = {0, 0};
  const int units = (a.interleaved ? a.rotary_dim / VEC : a.rotary_dim / 2 / VEC) + (a.head_dim - a.rotary_dim) / VEC;
  for (int i = 0; i < a.count; ++i) {
    const int64_t positions = a.ops[i].shape[0] * a.ops[i].shape[2];  // (b, n); heads are walked per thread
    blocks[i] = (positions * units + kBlock - 1) / kBlock;
  }
  const int64_t total = blocks[0] + blocks[1];
  if (total == 0) return cudaSuccess;
  if (total > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (a.interleaved)
    rows_kernel<TI, TC, TO, VEC, true><<<unsigned(total), kBlock, 0, stream>>>(a, unsigned(blocks[0]));
  else
    rows_kernel<TI, TC, TO, VEC, false><<<unsigned(total), kBlock, 0, stream>>>(a, unsigned(blocks[0]));
  return cudaGetLastError();
}

template <typename TI, typename TC, typename TO>
cudaError_t dispatch_vec(const Args& a, cudaStream_t stream) {
  if (vectorizable(a, 8)) return run<TI, TC, TO, 8>(a, stream);
  if (vectorizable(a, 2)) return run<TI, TC, TO, 2>(a, stream);
  if (!a.interleaved && vectorizable(a, 1)) return run<TI, TC, TO, 1>(a, stream);
  return cudaErrorInvalidValue;  // interleaved pairs need even sizes and strides
}

}  // namespace

template <class TI>
cudaError_t launch_rows_x(const Args& args, cudaStream_t stream) {
  return with_x_dtypes<TI>(args, [&](auto i, auto c, auto o) {
    return dispatch_vec<typename decltype(i)::type, typename decltype(c)::type, typename decltype(o)::type>(args, stream);
  });
}

}  // namespace tk_rotary
