// What the attention kernels add to the tile library (csrc/include/tk, whose primitives they use: semaphores, raw
// TMA forms, wgmma, named barriers, register reallocation): the block schedule, their 64-column panel layout and its
// wgmma descriptors, accumulator re-packing and stmatrix addressing, and the consumers' turns. Torch-free.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "tk/common.cuh"
#include "tk/ops/thread/math.cuh"
#include "tk/ops/thread/memory.cuh"
#include "tk/ops/thread/tma.cuh"
#include "tk/ops/warp/matrix.cuh"
#include "tk/ops/warpgroup/descriptor.cuh"
#include "tk/ops/warpgroup/mma.cuh"
#include "tk/ops/warpgroup/registers.cuh"
#include "tk/sync/semaphore.cuh"

namespace tk_attn {

// Task t of a grid over (head, block) pairs -> (head, rank of its block): heads are walked in sections of
// `section` heads, small enough that their operands stay in L2 while the grid works on them, and inside a
// section the ranks go outermost, so the blocks of one rank run across the section's heads together (the
// caller puts the heaviest blocks at rank 0). section = 1 walks head by head.
__device__ __forceinline__ void section_decode(int t, int heads_total, int ranks, int section, int& head,
                                               int& rank) {
  const int per_section = section * ranks;
  const int sec = t / per_section;
  const int r = t - sec * per_section;
  const int heads = min(section, heads_total - sec * section);
  rank = r / heads;
  head = sec * section + (r - rank * heads);
}

// Entry (b, i) of a (B, n, 2) int32 interval table (Scores::row_keys, key_rows), `none` without one.
__device__ __forceinline__ int2 interval(const int* table, int b, int n, int i, int2 none) {
  return table ? __ldg(reinterpret_cast<const int2*>(table) + (static_cast<int64_t>(b) * n + i)) : none;
}

// Heads per section for section_decode (host side): enough that a section holds about `blocks` blocks of `ranks`
// each, at most `max_heads` (an L2 budget) and `heads_total`, at least 1.
inline int section_heads(int64_t heads_total, int ranks, int64_t blocks, int64_t max_heads) {
  const int64_t by_blocks = (blocks + ranks - 1) / ranks;
  const int64_t h = by_blocks < max_heads ? by_blocks : max_heads;
  return static_cast<int>(h < 1 ? 1 : (h < heads_total ? h : heads_total));
}

// stmatrix .x4 (tk/ops/warp/matrix.cuh): one instruction stores what sixteen st.shared.b32 would; the backward's
// consumers were stalled on the MIO queue behind their shared stores (ncu). This lane's address inside a block of
// 16 rows x 32 bytes in acc_to_a's register order (the matrices at rows 0/8 x bytes 0/16): its row and byte column,
// in bytes so that the fp32 dQ staging uses it too.
using tk::stmatrix_x4;
__device__ __forceinline__ int stsm_row(int lane) { return (lane & 7) + tk::x4_mrow(lane); }
__device__ __forceinline__ int stsm_byte(int lane) { return 16 * (lane >> 4); }

// Two adjacent floats from shared (SHARED) or global memory.
template <bool SHARED>
__device__ __forceinline__ float2 load_pair(const float* p) {
  if constexpr (SHARED) {
    return tk::ld_shared_v2(tk::smem_addr(p));
  } else {
    return *reinterpret_cast<const float2*>(p);
  }
}
// Four adjacent floats (16-byte aligned) from shared (SHARED) or global memory.
template <bool SHARED>
__device__ __forceinline__ float4 load_quad(const float* p) {
  if constexpr (SHARED) {
    return tk::ld_shared_v4(tk::smem_addr(p));
  } else {
    return *reinterpret_cast<const float4*>(p);
  }
}

// Shared tiles are stored as column panels of 64 elements (128 bytes per row,
// the TMA box width for 128-byte swizzle), each panel [rows][64], 1024-byte
// aligned. Descriptor fields are in 16-byte units.
using tk::desc::encode;
// K-major operand (the contraction dim is the contiguous one): 8-row groups
// 1024 bytes apart; leading offset unused with 128-byte swizzle.
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t saddr) {
  return encode(saddr) | (encode(16) << 16) | (encode(1024) << 32) | (1ull << 62);
}
// MN-major operand (the output dim is contiguous): 64-wide panels `panel_bytes`
// apart, 8-row groups of the contraction dim 1024 bytes apart.
__device__ __forceinline__ uint64_t desc_mnmajor(uint32_t saddr, uint32_t panel_bytes) {
  return encode(saddr) | (encode(panel_bytes) << 16) | (encode(1024) << 32) | (1ull << 62);
}
// The descriptor of the k-th 16-deep slice from the operand's base descriptor d (one add, not a re-encoding):
// K-major panels of `rows` rows, or MN-major.
__device__ __forceinline__ uint64_t kmajor_step(uint64_t d, int k, int rows) {
  return tk::desc::add(d, tk::desc::kmajor_offset<128>(k, rows));
}
__device__ __forceinline__ uint64_t mnmajor_step(uint64_t d, int k) {
  return tk::desc::add(d, tk::desc::mnmajor_offset<128>(k));
}
// Two fp32 -> one packed 16-bit pair (low half = first element).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The wgmma accumulator of a 64 x N tile: thread (warp w, lane l) holds rows
// 16w + l/4 and +8; for each 8-column chunk c, d[4c+0..1] are row r0 columns
// 8c + 2(l%4) + {0,1} and d[4c+2..3] the same columns of row r0 + 8. A
// 64 x 16 A-operand slice kk is then chunks 2kk and 2kk+1 re-packed.
template <typename T, int K>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&d)[K], int kk) {
  const int c0 = 8 * kk, c1 = 8 * kk + 4;
  a[0] = pack2<T>(d[c0 + 0], d[c0 + 1]);
  a[1] = pack2<T>(d[c0 + 2], d[c0 + 3]);
  a[2] = pack2<T>(d[c1 + 0], d[c1 + 1]);
  a[3] = pack2<T>(d[c1 + 2], d[c1 + 3]);
}

// Byte offset of element (row, col) inside a [rows][64] 128-byte-swizzled panel
// (16-byte chunk index XOR row % 8), the layout TMA writes and wgmma reads.
__device__ __forceinline__ uint32_t swz128(int row, int col, int elem_bytes) {
  const uint32_t byte = col * elem_bytes;
  return row * 128 + ((((byte >> 4) ^ (row & 7)) << 4) | (byte & 15));
}

// Turns at the tensor cores for NC consumer warpgroups (the forward's ping-pong, the backward's TURNS): consumer c
// waits on named barrier FIRST + c, and passes the turn by arriving on the next consumer's (256 threads: the
// waiter and the one handing over). ON = false: no-ops.
// The last consumer passes once before the loop so that consumer 0 goes first, and consumer 0 takes that final
// hand-over after it.
template <bool ON, int FIRST, int NC>
struct Turns {
  static __device__ __forceinline__ void wait(int c) {
    if constexpr (ON) tk::named_sync(FIRST + c, 256);
  }
  static __device__ __forceinline__ void pass(int c) {
    if constexpr (ON) tk::named_arrive(FIRST + (c + 1) % NC, 256);
  }
  // One turn: wait, issue (the caller's wgmmas), pass.
  template <typename F>
  static __device__ __forceinline__ void take(int c, F&& issue) {
    wait(c);
    issue();
    pass(c);
  }
};

}  // namespace tk_attn
