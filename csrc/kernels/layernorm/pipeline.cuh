// Multi-stage staging of row vectors in shared memory with cp.async, for the persistent ("pipe") variants.
// A register-only kernel keeps one row's loads in flight per thread and then waits on its reductions;
// staging STAGES rows ahead keeps HBM busy through those waits without spending registers on the data.
//
// Every thread copies and later reads back only its own 16-byte slots (column threadIdx.x of the staging
// area), so cp.async.wait_group alone makes the data visible: no block barrier guards the stages, and a
// warp's 16-byte accesses cover 512 contiguous bytes (no bank conflicts).
#pragma once
#include <cuda_runtime.h>

#include "config.cuh"
#include "tk/grid.cuh"
#include "tk/ops/thread/cp_async.cuh"
#include "tk/ops/thread/memory.cuh"

namespace tk_layernorm {

// Shared memory is addressed with 32-bit shared-window addresses throughout: generic 64-bit pointers
// cost two registers each and may compile to generic loads.
using tk::cp_async16;
using tk::cp_async4;
using tk::cp_async_commit;
using tk::cp_async_wait;
using tk::ld_shared_f32;
using tk::ld_shared_u4;

// Dynamic shared memory laid out as [STAGES][ops][VECS][CHUNKS][BLOCK] 16-byte chunks, then (when
// STATS and FIXED) [VECS][CHUNKS][BLOCK] chunks for a per-thread constant vector (the weight: shared memory
// is cheaper than registers there) and (when STATS) [STAGES][2][BLOCK] floats for the row's mean and rstd.
// CHUNKS: the 16-byte chunks of 8 elements of the widest staged operand (1 for 16-bit, 2 for fp32); a narrower
// operand uses the first of its slot's chunks. `ops` is a runtime count so absent operands (no dh) cost no shared
// memory and no occupancy.
template <int CHUNKS, class S, int STAGES, bool STATS, bool FIXED = STATS>
struct Staging {
  static_assert(CHUNKS == 1 || CHUNKS == 2, "8 elements of 16- or 32-bit types");
  static constexpr uint32_t FIXED_BYTES = STATS && FIXED ? S::VECS * CHUNKS * 16 * S::BLOCK : 0;

  static constexpr size_t bytes(int ops) {
    return size_t(STAGES) * ops * S::VECS * CHUNKS * 16 * S::BLOCK + FIXED_BYTES +
           (STATS ? STAGES * 2 * sizeof(float) * S::BLOCK : 0);
  }

  uint32_t base;  // shared-window address of the area, plus this thread's column
  int ops;

  __device__ __forceinline__ Staging(void* area, int ops_)
      : base(static_cast<uint32_t>(__cvta_generic_to_shared(area)) + 16u * threadIdx.x), ops(ops_) {}

  __device__ __forceinline__ uint32_t slot(int stage, int op, int v) const {
    return base + 16u * uint32_t(((stage * ops + op) * S::VECS + v) * CHUNKS * S::BLOCK);
  }
  __device__ __forceinline__ uint32_t fixed(int v) const { return slot(STAGES, 0, 0) + 16u * uint32_t(v * CHUNKS * S::BLOCK); }
  __device__ __forceinline__ uint32_t stat(int stage, int k) const {
    const uint32_t stats = slot(STAGES, 0, 0) + FIXED_BYTES - 12u * threadIdx.x;  // floats: 4 bytes per thread, not 16
    return stats + 4u * uint32_t((stage * 2 + k) * S::BLOCK);
  }
  template <typename E>
  __device__ __forceinline__ void copy_at(uint32_t dst, const E* src) const {
    static_assert(int(sizeof(E)) / 2 <= CHUNKS, "the slot holds 8 elements of E");
#pragma unroll
    for (int c = 0; c < int(sizeof(E)) / 2; ++c) cp_async16(dst + 16u * (c * S::BLOCK), reinterpret_cast<const uint4*>(src) + c);
  }
  template <typename E>
  __device__ __forceinline__ Pack8<E> read(int stage, int op, int v) const { return read_at<E>(slot(stage, op, v)); }
  template <typename E>
  __device__ __forceinline__ Pack8<E> read_fixed(int v) const { return read_at<E>(fixed(v)); }
  template <typename E>
  __device__ __forceinline__ void copy_fixed(int v, const E* src) const { copy_at(fixed(v), src); }
  template <typename E>
  __device__ __forceinline__ void copy(int stage, int op, int v, const E* src) const { copy_at(slot(stage, op, v), src); }
  template <typename E>
  __device__ __forceinline__ Pack8<E> read_at(uint32_t src) const {
    Pack8<E> p;
#pragma unroll
    for (int c = 0; c < int(sizeof(E)) / 2; ++c) {
      const uint4 q = ld_shared_u4(src + 16u * (c * S::BLOCK));
      p.w[4 * c] = q.x, p.w[4 * c + 1] = q.y, p.w[4 * c + 2] = q.z, p.w[4 * c + 3] = q.w;
    }
    return p;
  }
  __device__ __forceinline__ float read_stat(int stage, int k) const { return ld_shared_f32(stat(stage, k)); }
  __device__ __forceinline__ void copy_stat(int stage, int k, const float* src) const { cp_async4(stat(stage, k), src); }
};

// This thread's walk over row groups in the persistent kernels: block b takes groups b, b + gridDim.x, ...
// 32-bit row indices (the host guarantees rows + (STAGES + 1) * step < 2^31): fewer registers.
struct RowWalk {
  int iters;  // loop iterations, the same for the whole block
  int step;   // rows from one iteration to the next
  int first;  // this thread's row in the first iteration
};

template <class S>
__device__ __forceinline__ RowWalk row_walk(int rows) {
  const int groups = (rows + S::ROWS - 1) / S::ROWS;
  return {(groups - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x), int(gridDim.x) * S::ROWS,
          int(blockIdx.x) * S::ROWS + int(threadIdx.x) / S::TPR};
}

// Blocks of `kernel` resident per SM with `smem` bytes of dynamic shared memory (0: it cannot run), and
// the SM count. Cached per (kernel, smem, device): the queries cost microseconds, a small launch less.
struct Residency {
  int per_sm = 0, sms = 0;
};
Residency residency(const void* kernel, int block, size_t smem);

// At least `smem` bytes of dynamic shared memory, and enough that at most `per_sm` blocks fit on an SM: a cap
// on a persistent grid's blocks per SM that the hardware honours (a smaller grid alone may be packed unevenly).
size_t smem_for_residency(size_t smem, int per_sm);

// Persistent grid: at most as many blocks as are resident at once, each looping over the same number of
// row groups (tasks): with 16384 groups on 528 resident blocks, 512 blocks of 32 groups finish together,
// where 528 would leave 16 blocks a 32nd group to run alone at the end. 0 when the kernel does not fit.
// The kernels count rows in 32 bits, up to rows + (STAGES + 1) * blocks * rows_per_block: beyond that, 0 too.
template <int STAGES, typename K>
int persistent_grid(K* kernel, int block, size_t smem, int64_t rows, int rows_per_block) {
  const Residency r = residency(reinterpret_cast<const void*>(kernel), block, smem);
  if (r.per_sm <= 0) return 0;
  const int64_t tasks = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t resident = int64_t(r.sms) * r.per_sm;
  const int64_t per_block = (tasks + resident - 1) / resident;
  const int64_t blocks = tasks < 1 ? 1 : (tasks + per_block - 1) / per_block;
  if (rows + (STAGES + 1) * blocks * rows_per_block >= (int64_t(1) << 31)) return 0;
  return int(blocks);
}

}  // namespace tk_layernorm
