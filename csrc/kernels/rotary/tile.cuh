// Rotary embedding, tile kernel (rotary.h), instantiated per x dtype in tile_<x>.cu.
// A block owns (b, a few consecutive positions, one group of heads). Its threads are (position, unit); a unit is
// two VEC-wide chunks of a head's row: a NeoX pair (j, j + rotary_dim/2), or chunks k and k + half of the
// interleaved or pass-through region (so each warp-wide access covers a contiguous span, never every other
// chunk). So every thread does the same two loads and two stores per head, pass-through threads of partial
// rotary included (they store their chunks unchanged), keeps its cos/sin in registers across its heads, and
// walks the group's heads of q then of k with FLIGHT heads' loads issued before any store.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "pack.cuh"
#include "rotary.h"
#include "tk/common.cuh"

namespace tk_rotary {
namespace {

struct Shape {
  int units;      // per position
  int rot_units;  // units [0, rot_units) rotate; the rest copy pass-through channels
  int positions;  // per block
  int tiles;      // position tiles per batch entry
  int groups;     // head groups per tile (fastest-varying block index: neighbours share cos/sin in L2)
  int heads;      // per group
  int rows0;      // heads of operand 0
  int rows;       // heads of both operands
};

// Register budget, the least that avoids spills: 80 at 4 heads in flight (768 threads/SM with 128 bytes of loads
// each). The addresses of a batch's loads and stores take as many registers as its data. Mixed dtypes (fp32
// tables or output beside 16-bit x) hold twice the words per table or output pack: 2 heads in flight.
template <typename TI, typename TC, typename TO>
constexpr bool kOneSize = sizeof(TI) == sizeof(TC) && sizeof(TI) == sizeof(TO);
template <typename TI, typename TC, typename TO>
constexpr int kFlight = kOneSize<TI, TC, TO> ? 4 : 2;

template <typename TI, typename TC, typename TO, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kMaxTileThreads, (kOneSize<TI, TC, TO> ? 3 : 2)) tile_kernel(Args a, Shape s) {
  using PI = Pack<TI, VEC>;
  using PC = Pack<TC, VEC>;
  using PO = Pack<TO, VEC>;
  constexpr int FLIGHT = kFlight<TI, TC, TO>;
  const int u = int(threadIdx.x) % s.units, p = int(threadIdx.x) / s.units;
  unsigned bid = blockIdx.x;
  const int g = int(bid % unsigned(s.groups));
  bid /= unsigned(s.groups);
  const int64_t n = int64_t(bid % unsigned(s.tiles)) * s.positions + p;
  const int64_t b = bid / unsigned(s.tiles);
  const Operand& o0 = a.ops[0];  // both operands share B, N and the cos/sin strides (launch_tile checks)
  if (n >= o0.shape[2]) return;

  // This thread's chunks: element offsets ja, jb in the row.
  const bool rot = u < s.rot_units;
  const int k = rot ? u : u - s.rot_units;
  const int chunks = (rot ? a.rotary_dim : a.head_dim - a.rotary_dim) / VEC, half = (chunks + 1) / 2;
  const int base = rot ? 0 : a.rotary_dim;
  const int ja = base + k * VEC;
  const int jb = base + (k + half < chunks ? k + half : k) * VEC;  // odd chunk count: the last unit does one chunk twice

  const int64_t cs = b * o0.cs_stride[0] + n * o0.cs_stride[2];
  const TC* cosp = static_cast<const TC*>(o0.cos) + cs;
  const TC* sinp = static_cast<const TC*>(o0.sin) + cs;
  // Tables per position only (per-head tables go to the row kernel): loaded once, kept across the heads.
  PC ca, cb, sa, sb;
  if (rot) {
    ca = load_pack<PC>(cosp + ja);
    cb = load_pack<PC>(cosp + jb);
    sa = load_pack<PC>(sinp + ja);
    sb = load_pack<PC>(sinp + jb);
  }
  // Backward, y = x·c + rotᵀ(x·s), is the forward formula with s replaced by the partner's -s
  // (NeoX: s'a = -sb, s'b = -sa; interleaved: each pair swapped and negated), done once here on the packed words.
  if (rot && a.backward) {
    if constexpr (INTERLEAVED) {
#pragma unroll
      for (int i = 0; i < PC::WORDS; ++i) {
        if constexpr (sizeof(TC) == 4) {
          if (i % 2) continue;
          const uint32_t t = sa.w[i];
          sa.w[i] = sa.w[i + 1] ^ PC::SIGNS, sa.w[i + 1] = t ^ PC::SIGNS;
          const uint32_t v = sb.w[i];
          sb.w[i] = sb.w[i + 1] ^ PC::SIGNS, sb.w[i + 1] = v ^ PC::SIGNS;
        } else {  // a pair is one 32-bit word: swap its halves
          sa.w[i] = __byte_perm(sa.w[i], 0, 0x1032) ^ PC::SIGNS;
          sb.w[i] = __byte_perm(sb.w[i], 0, 0x1032) ^ PC::SIGNS;
        }
      }
    } else {
      const PC t = sa;
#pragma unroll
      for (int i = 0; i < PC::WORDS; ++i) sa.w[i] = sb.w[i] ^ PC::SIGNS, sb.w[i] = t.w[i] ^ PC::SIGNS;
    }
  }

  // Pair by pair; with one dtype throughout a head's results take its inputs' registers. tk::pin makes the
  // table words look redefined per head: otherwise the compiler hoists their unpacking to floats out of the head
  // loop (4x the registers) and spills.
  auto rotate = [&](const PI& xa, const PI& xb, PO& ya, PO& yb) {
#pragma unroll
    for (int i = 0; i < PC::WORDS; ++i) {
      tk::pin(ca.w[i]);
      tk::pin(cb.w[i]);
      tk::pin(sa.w[i]);
      tk::pin(sb.w[i]);
    }
    if constexpr (VEC == 1) {  // NeoX only
      const float x1 = xa.get(0), x2 = xb.get(0);
      ya.set_one(x1 * ca.get(0) - x2 * sa.get(0));
      yb.set_one(x2 * cb.get(0) + x1 * sb.get(0));
    } else {
#pragma unroll
      for (int q = 0; q < VEC / 2; ++q) {
        const int e = 2 * q;
        const float a0 = xa.get(e), a1 = xa.get(e + 1), b0 = xb.get(e), b1 = xb.get(e + 1);
        if constexpr (INTERLEAVED) {  // pairs (e, e+1) within each pack
          ya.set_pair(q, a0 * ca.get(e) - a1 * sa.get(e), a1 * ca.get(e + 1) + a0 * sa.get(e + 1));
          yb.set_pair(q, b0 * cb.get(e) - b1 * sb.get(e), b1 * cb.get(e + 1) + b0 * sb.get(e + 1));
        } else {  // pairs (a[e], b[e])
          ya.set_pair(q, a0 * ca.get(e) - b0 * sa.get(e), a1 * ca.get(e + 1) - b1 * sa.get(e + 1));
          yb.set_pair(q, b0 * cb.get(e) + a0 * sb.get(e), b1 * cb.get(e + 1) + a1 * sb.get(e + 1));
        }
      }
    }
  };

  // Heads [h0, h1) of one operand. Stores could alias the loads as far as the compiler knows, so the
  // loads of a batch are written before its stores to keep them all in flight.
  auto walk = [&](const Operand& o, int h0, int h1) {
    const TI* in = static_cast<const TI*>(o.in) + b * o.in_stride[0] + n * o.in_stride[2];
    TO* out = static_cast<TO*>(o.out) + b * o.out_stride[0] + n * o.out_stride[2];
    for (int h = h0; h < h1; h += FLIGHT) {
      PI xa[FLIGHT], xb[FLIGHT];
#pragma unroll
      for (int i = 0; i < FLIGHT; ++i) {
        if (h + i < h1) {
          const TI* x = in + int64_t(h + i) * o.in_stride[1];
          xa[i] = load_pack<PI>(x + ja);
          xb[i] = load_pack<PI>(x + jb);
        }
      }
#pragma unroll
      for (int i = 0; i < FLIGHT; ++i) {
        if (h + i >= h1) break;
        TO* y = out + int64_t(h + i) * o.out_stride[1];
        if constexpr (std::is_same_v<TI, TO>) {  // in place: the results take the inputs' registers
          if (rot) rotate(xa[i], xb[i], xa[i], xb[i]);
          store_pack<PO>(y + ja, xa[i]);
          store_pack<PO>(y + jb, xb[i]);
        } else {  // pass-through channels are converted to y's dtype
          PO ya, yb;
          if (rot) {
            rotate(xa[i], xb[i], ya, yb);
          } else {
            ya.convert(xa[i]);
            yb.convert(xb[i]);
          }
          store_pack<PO>(y + ja, ya);
          store_pack<PO>(y + jb, yb);
        }
      }
    }
  };
  const int r0 = g * s.heads, r1 = std::min(r0 + s.heads, s.rows);
  if (r0 < s.rows0) walk(a.ops[0], r0, std::min(r1, s.rows0));
  if (r1 > s.rows0) walk(a.ops[1], std::max(r0, s.rows0) - s.rows0, r1 - s.rows0);
}

inline int div_up(int64_t a, int64_t b) { return int((a + b - 1) / b); }

// A block of 128 threads, 4 heads per thread (the best worst case over the head dims and layouts measured on the
// H200; RESULTS.md, rotary).
constexpr int kThreads = 128, kHeadsPerThread = 4;

template <typename TI, typename TC, typename TO, int VEC, bool INTERLEAVED>
cudaError_t go(const Args& a, cudaStream_t stream) {
  const int rot_chunks = a.rotary_dim / VEC, pass_chunks = (a.head_dim - a.rotary_dim) / VEC;
  Shape s{};
  s.rot_units = (rot_chunks + 1) / 2;
  s.units = s.rot_units + (pass_chunks + 1) / 2;
  const int threads = std::max(kThreads, (s.units + 31) / 32 * 32);
  if (threads > kMaxTileThreads) return cudaErrorNotSupported;
  s.positions = threads / s.units;
  const int64_t B = a.ops[0].shape[0], N = a.ops[0].shape[2];
  const int64_t rows = a.ops[0].shape[1] + (a.count == 2 ? a.ops[1].shape[1] : 0);
  if (B == 0 || N == 0 || rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorNotSupported;
  s.rows0 = int(a.ops[0].shape[1]);
  s.rows = int(rows);
  s.heads = std::min(kHeadsPerThread, s.rows);
  s.groups = div_up(s.rows, s.heads);
  s.tiles = div_up(N, s.positions);
  const int64_t blocks = B * s.tiles * s.groups;
  if (blocks > 0x7fffffff) return cudaErrorNotSupported;
  tile_kernel<TI, TC, TO, VEC, INTERLEAVED><<<unsigned(blocks), s.positions * s.units, 0, stream>>>(a, s);
  return cudaGetLastError();
}

template <typename TI, typename TC, typename TO, int VEC>
cudaError_t pick(const Args& a, cudaStream_t stream) {
  if constexpr (VEC == 1) {  // interleaved pairs never split across packs: VEC 1 is NeoX only (checked by the caller)
    return go<TI, TC, TO, 1, false>(a, stream);
  } else {
    return a.interleaved ? go<TI, TC, TO, VEC, true>(a, stream) : go<TI, TC, TO, VEC, false>(a, stream);
  }
}

// 16-byte accesses of x where every pointer, stride and size allows them; narrower ones (odd shapes and strides)
// otherwise.
template <typename TI, typename TC, typename TO>
cudaError_t dispatch(const Args& a, cudaStream_t stream) {
  constexpr int wide = 16 / int(sizeof(TI));
  if (vectorizable(a, wide)) return pick<TI, TC, TO, wide>(a, stream);
  if constexpr (wide > 4) {
    if (vectorizable(a, 4)) return pick<TI, TC, TO, 4>(a, stream);
  }
  if (vectorizable(a, 2)) return pick<TI, TC, TO, 2>(a, stream);
  if (!a.interleaved && vectorizable(a, 1)) return pick<TI, TC, TO, 1>(a, stream);
  return cudaErrorInvalidValue;  // interleaved pairs need even sizes and strides
}

// q and k share a block only when they share B, N and the cos/sin indexing; otherwise one launch each.
inline bool shared_tiles(const Args& a) {
  const Operand &q = a.ops[0], &k = a.ops[1];
  if (q.shape[0] != k.shape[0] || q.shape[2] != k.shape[2] || q.cos != k.cos || q.sin != k.sin) return false;
  for (int d = 0; d < 3; ++d)
    if (q.cs_stride[d] != k.cs_stride[d]) return false;
  return true;
}

template <class TI>
cudaError_t by_dtype(const Args& a, cudaStream_t stream) {
  return with_x_dtypes<TI>(a, [&](auto i, auto c, auto o) {
    return dispatch<typename decltype(i)::type, typename decltype(c)::type, typename decltype(o)::type>(a, stream);
  });
}

}  // namespace

template <class TI>
cudaError_t launch_tile_x(const Args& args, cudaStream_t stream) {
  // A dim of size 1 is only ever indexed at 0, so its stride is free: zero it, so that a single (k/v) head
  // does not look like per-head tables and an odd stride there does not narrow the vectors.
  Args a = args;
  for (int i = 0; i < a.count; ++i)
    for (int d = 0; d < 3; ++d)
      if (a.ops[i].shape[d] == 1) a.ops[i].in_stride[d] = a.ops[i].out_stride[d] = a.ops[i].cs_stride[d] = 0;
  for (int i = 0; i < a.count; ++i)
    if (a.ops[i].cs_stride[1] != 0) return cudaErrorNotSupported;  // per-head tables (rare): the row kernel
  if (a.count == 2 && !shared_tiles(a)) {
    Args one = a;
    one.count = 1;
    for (int i = 0; i < 2; ++i) {
      one.ops[0] = a.ops[i];
      const cudaError_t err = by_dtype<TI>(one, stream);
      if (err != cudaSuccess) return err;  // NotSupported: the caller redoes both with the row kernel
    }
    return cudaSuccess;
  }
  return by_dtype<TI>(a, stream);
}

}  // namespace tk_rotary
