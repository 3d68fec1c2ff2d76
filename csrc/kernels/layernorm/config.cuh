// Per-row work split by hidden size, shared by forward and backward.
// Each thread owns VECS vectors of 8 elements at columns 8 * (v * TPR + lane): coalesced across the row's
// threads. Small rows take one warp (several rows per block), large rows a whole block; the last
// vectors of a row may be partly out of range (hidden is any multiple of 8) and are masked, never skipped.
#pragma once
#include "layernorm.h"
#include "vec.cuh"
#include "tk/grid.cuh"

namespace tk_layernorm {

template <int TPR_, int VECS_, int MIN_BLOCK = 256>
struct Split {
  static constexpr int TPR = TPR_;                                  // threads per row
  static constexpr int VECS = VECS_;                                // 8-element vectors per thread
  static constexpr int BLOCK = TPR < MIN_BLOCK ? MIN_BLOCK : TPR;   // threads per block
  static constexpr int ROWS = BLOCK / TPR;              // rows per block
  static constexpr int WARPS_PER_ROW = TPR / 32;
  static constexpr int MAX_HIDDEN = TPR * VECS * 8;
  static_assert(TPR % 32 == 0 && BLOCK % TPR == 0 && BLOCK <= 1024, "rows are whole warps of one block");
};

// Calls f(Split<...>{}) for the smallest split that covers `hidden`. The backward keeps more per
// thread alive (dy, h and the dw/db accumulators), so it gives each thread one vector per row and
// spreads a row over more threads. FWD_BLOCK: the forward's smallest block (256; 32 gives one row per
// block with the same per-row work, forward variant 7).
template <bool BACKWARD, int FWD_BLOCK = 256, typename F>
cudaError_t with_split(int hidden, F&& f) {
  if constexpr (BACKWARD) {
    if (hidden <= 256) return f(Split<32, 1>{});
    if (hidden <= 512) return f(Split<64, 1>{});
    if (hidden <= 1024) return f(Split<128, 1>{});
    if (hidden <= 2048) return f(Split<256, 1>{});
    if (hidden <= 4096) return f(Split<512, 1>{});
    if (hidden <= 8192) return f(Split<1024, 1>{});
    if (hidden <= kMaxHidden) return f(Split<1024, 2>{});
  } else {
    if (hidden <= 256) return f(Split<32, 1, FWD_BLOCK>{});
    if (hidden <= 512) return f(Split<32, 2, FWD_BLOCK>{});
    if (hidden <= 1024) return f(Split<32, 4, FWD_BLOCK>{});
    if (hidden <= 2048) return f(Split<128, 2, FWD_BLOCK>{});
    if (hidden <= 4096) return f(Split<256, 2, FWD_BLOCK>{});
    // Large rows: 4 vectors per thread and 256-thread blocks keep several rows in flight per SM
    // (a block per row waits on its reductions; more resident blocks overlap those waits).
    if (hidden <= 8192) return f(Split<256, 4, FWD_BLOCK>{});
    if (hidden <= kMaxHidden) return f(Split<512, 4, FWD_BLOCK>{});
  }
  return cudaErrorInvalidValue;
}

// Splits of the persistent ("pipe") variants. Their data waits in shared memory, not registers, so the
// backward can afford VB vectors per thread (fewer threads per row, cheaper row sums, more dw/db
// registers); the forward keeps the splits above in 128-thread blocks (finer grain for the grid).
// VB = 4 gives rows up to 1024 one warp each (no block barrier in the row sums), and stops at 8192;
// blocks of at least MIN_BLOCK threads.
template <bool BACKWARD, int VB, int MIN_BLOCK = 256, typename F>
cudaError_t with_pipe_split(int hidden, F&& f) {
  static_assert(VB == 1 || VB == 2 || VB == 4, "one, two or four vectors per thread");
  if constexpr (BACKWARD && VB == 4) {
    if (hidden <= 256) return f(Split<32, 1, MIN_BLOCK>{});
    if (hidden <= 512) return f(Split<32, 2, MIN_BLOCK>{});
    if (hidden <= 1024) return f(Split<32, 4, MIN_BLOCK>{});
    if (hidden <= 2048) return f(Split<64, 4, MIN_BLOCK>{});
    if (hidden <= 4096) return f(Split<128, 4, MIN_BLOCK>{});
    if (hidden <= 8192) return f(Split<256, 4, MIN_BLOCK>{});
    return cudaErrorNotSupported;  // 512 threads of 4 vectors would need more than 128 registers
  } else if constexpr (BACKWARD) {
    if (hidden <= 256) return f(Split<32, 1, MIN_BLOCK>{});
    if (hidden <= 512) return f(Split<64 / VB, VB, MIN_BLOCK>{});
    if (hidden <= 1024) return f(Split<128 / VB, VB, MIN_BLOCK>{});
    if (hidden <= 2048) return f(Split<256 / VB, VB, MIN_BLOCK>{});
    if (hidden <= 4096) return f(Split<512 / VB, VB, MIN_BLOCK>{});
    if (hidden <= 8192) return f(Split<1024 / VB, VB, MIN_BLOCK>{});
    if (hidden <= kMaxHidden) return f(Split<1024, 2, MIN_BLOCK>{});
  } else {
    if (hidden <= 256) return f(Split<32, 1, 128>{});
    if (hidden <= 512) return f(Split<32, 2, 128>{});
    if (hidden <= 1024) return f(Split<32, 4, 128>{});
    if (hidden <= 2048) return f(Split<128, 2, 128>{});
    if (hidden <= 4096) return f(Split<256, 2, 128>{});
    if (hidden <= 8192) return f(Split<256, 4, 128>{});
    if (hidden <= kMaxHidden) return f(Split<512, 4, 128>{});
  }
  return cudaErrorInvalidValue;
}

// One row per block, spread over hidden / (8 * VB) threads (rounded up to a warp, at most 1024): few
// rows in flight per SM and many short blocks, the shape torch.compile's persistent reductions take
// (the forward variants 4 and 5 test it against the legacy warp-per-row split at small hidden).
template <int VB, typename F>
cudaError_t with_row_split(int hidden, F&& f) {
  static_assert(VB == 1 || VB == 2, "one or two vectors per thread");
  if (hidden <= 256 * VB) return f(Split<32, VB, 32>{});
  if (hidden <= 512 * VB) return f(Split<64, VB, 64>{});
  if (hidden <= 1024 * VB) return f(Split<128, VB, 128>{});
  if (hidden <= 2048 * VB) return f(Split<256, VB, 256>{});
  if (hidden <= 4096 * VB) return f(Split<512, VB, 512>{});
  if (hidden <= 8192 * VB) return f(Split<1024, VB, 1024>{});
  if (hidden <= kMaxHidden) return f(Split<1024, 2, 1024>{});
  return cudaErrorInvalidValue;
}

template <typename F>
cudaError_t with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f16: return f(__half{});
    case DType::bf16: return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Sum of v over the TPR threads of each row; every thread of the block must call it (it syncs).
// The cross-warp order is fixed, so results are deterministic.
template <class S>
__device__ __forceinline__ float row_sum(float v, float* smem /* [S::BLOCK / 32] */) {
  v = warp_sum(v);
  if constexpr (S::WARPS_PER_ROW == 1) {
    return v;
  } else {
    __syncthreads();  // smem may still be read by a previous row_sum
    if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = v;
    __syncthreads();
    const float* mine = smem + (threadIdx.x / S::TPR) * S::WARPS_PER_ROW;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < S::WARPS_PER_ROW; ++i) s += mine[i];
    return s;
  }
}

}  // namespace tk_layernorm
