// Per-row work split by hidden size, shared by forward and backward.
// Each thread owns VECS vectors of 8 elements at columns 8 * (v * TPR + lane): coalesced across the row's
// threads. Small rows take one warp (several rows per block), large rows a whole block; the last
// vectors of a row may be partly out of range (hidden is any multiple of 8) and are masked, never skipped.
#pragma once
#include <type_traits>

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

// Row lengths, hidden up to 2048 or longer: the two halves of every launcher's tiers, each instantiated in its own
// translation unit (with the dtype split below) so that they compile in parallel. with_split and with_row_split
// instantiate only their half's tiers; with_rows calls f(integral_constant<Rows, ·>) for a call's half.
enum class Rows { short_rows, long_rows };
inline Rows rows_of(int hidden) { return hidden <= 2048 ? Rows::short_rows : Rows::long_rows; }
template <typename F>
cudaError_t with_rows(int hidden, F&& f) {
  if (rows_of(hidden) == Rows::short_rows) return f(std::integral_constant<Rows, Rows::short_rows>{});
  return f(std::integral_constant<Rows, Rows::long_rows>{});
}

// Calls f(Split<...>{}) for the smallest split that covers `hidden`, for the register-only backward (backward.cuh):
// it keeps dy, h and the dw/db accumulators alive, so it gives each thread one vector per row and spreads a row over
// more threads. Tiers of 640 and 768 threads keep rows of 5120 and 6144 (common hidden sizes) from running with a
// third of a 1024-thread block idle and spilling (H200, autocast rows 65536 x 5120: 1.62 against 1.86 ms).
// GATED (rows recomputed from x and the gate, both kept in registers): two vectors a thread at 2049..4096
// (65536 x 4096: 1.11 against 1.34 ms). A template parameter, so each kind instantiates only its own splits.
template <Rows R, bool GATED = false, typename F>
cudaError_t with_split(int hidden, F&& f) {
  if (rows_of(hidden) != R) return cudaErrorInvalidValue;
  if constexpr (R == Rows::short_rows) {
    if (hidden <= 256) return f(Split<32, 1>{});
    if (hidden <= 512) return f(Split<64, 1>{});
    if (hidden <= 1024) return f(Split<128, 1>{});
    return f(Split<256, 1>{});
  } else {
    if (hidden <= 4096) {
      if constexpr (GATED) return f(Split<256, 2>{});
      else return f(Split<512, 1>{});
    }
    if (hidden <= 5120) return f(Split<640, 1>{});
    if (hidden <= 6144) return f(Split<768, 1>{});
    if (hidden <= 8192) return f(Split<1024, 1>{});
    if (hidden <= kMaxHidden) return f(Split<1024, 2>{});
    return cudaErrorInvalidValue;
  }
}

// One row per block, spread over hidden / 16 threads (rounded up to a warp, at most 1024), two vectors each: few
// rows in flight per SM and many short blocks, the shape of torch.compile's persistent reductions (the forward).
// Tiers of 320 and 384 threads for rows of 5120 and 6144 (H200, 65536 x 5120: bf16 0.72 -> 0.63 ms, autocast rows
// 1.21 -> 0.95 ms, the gated norm 1.12 -> 0.76 ms).
template <Rows R, typename F>
cudaError_t with_row_split(int hidden, F&& f) {
  if (rows_of(hidden) != R) return cudaErrorInvalidValue;
  if constexpr (R == Rows::short_rows) {
    if (hidden <= 512) return f(Split<32, 2, 32>{});
    if (hidden <= 1024) return f(Split<64, 2, 64>{});
    return f(Split<128, 2, 128>{});
  } else {
    if (hidden <= 4096) return f(Split<256, 2, 256>{});
    if (hidden <= 5120) return f(Split<320, 2, 320>{});
    if (hidden <= 6144) return f(Split<384, 2, 384>{});
    if (hidden <= 8192) return f(Split<512, 2, 512>{});
    if (hidden <= kMaxHidden) return f(Split<1024, 2, 1024>{});
    return cudaErrorInvalidValue;
  }
}

// The element types of one call (layernorm.h DTypes): X for x and dx, H for the residual, h and dres, W for the
// weight, bias, dw and db, Y for y and dy.
template <typename X_, typename H_, typename W_, typename Y_>
struct Types {
  using X = X_;
  using H = H_;
  using W = W_;
  using Y = Y_;
  // Some operand holds 4-byte elements: twice the registers per vector (register budgets follow it).
  static constexpr bool WIDE = sizeof(X) == 4 || sizeof(H) == 4 || sizeof(W) == 4 || sizeof(Y) == 4;
};

constexpr int types_key(DType x, DType h, DType w, DType y) {
  return ((int(x) * 3 + int(h)) * 3 + int(w)) * 3 + int(y);
}

// The dtypes of the kernels that run a call: a gated call runs the fp32-row kernels (x and the gate are read in their
// own dtypes at run time), keeping the weight's and the output's.
inline DTypes kernel_types(DTypes t, bool gated) {
  return gated ? DTypes{DType::f32, DType::f32, t.w, t.y} : t;
}

// Calls f(Types<...>{}) for the dtype combinations of supported(); cudaErrorInvalidValue for the others.
// X in {f32, f16, bf16}; H is X or f32; Y is f32 or the 16-bit dtype (x's, when x is 16-bit); W is f32 or Y.
template <typename F>
cudaError_t with_types(DTypes t, F&& f) {
  using f32 = float;
  using f16 = __half;
  using bf16 = __nv_bfloat16;
  constexpr DType F32 = DType::f32, F16 = DType::f16, BF16 = DType::bf16;
  switch (types_key(t.x, t.h, t.w, t.y)) {
    case types_key(F32, F32, F32, F32): return f(Types<f32, f32, f32, f32>{});
    case types_key(F32, F32, F32, F16): return f(Types<f32, f32, f32, f16>{});
    case types_key(F32, F32, F16, F16): return f(Types<f32, f32, f16, f16>{});
    case types_key(F32, F32, F32, BF16): return f(Types<f32, f32, f32, bf16>{});
    case types_key(F32, F32, BF16, BF16): return f(Types<f32, f32, bf16, bf16>{});
#define TK_LN_HALF(T, N)                                                           \
    case types_key(N, N, N, N): return f(Types<T, T, T, T>{});                     \
    case types_key(N, N, F32, N): return f(Types<T, T, f32, T>{});                 \
    case types_key(N, N, F32, F32): return f(Types<T, T, f32, f32>{});             \
    case types_key(N, F32, N, N): return f(Types<T, f32, T, T>{});                 \
    case types_key(N, F32, F32, N): return f(Types<T, f32, f32, T>{});             \
    case types_key(N, F32, F32, F32): return f(Types<T, f32, f32, f32>{});
    TK_LN_HALF(f16, F16)
    TK_LN_HALF(bf16, BF16)
#undef TK_LN_HALF
    default: return cudaErrorInvalidValue;
  }
}

// The launchers are split by x's dtype and row length (Rows), each instantiated in its own translation unit
// (forward_<x>_<rows>.cu, forward_gated_<rows>.cu, backward_<x>_<rows>.cu, backward_gated_<rows>.cu,
// backward_pipe_<x>[_lean].cu), so that the family's ~450 kernels compile in parallel. with_x calls f(X{}) for x's
// dtype; with_x_types is with_types for the combinations with that X (the others are not instantiated).
template <typename F>
cudaError_t with_x(DType x, F&& f) {
  switch (x) {
    case DType::f32: return f(float{});
    case DType::f16: return f(__half{});
    case DType::bf16: return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}
template <class X, typename F>
cudaError_t with_x_types(DTypes t, F&& f) {
  return with_types(t, [&](auto ty) {
    if constexpr (std::is_same_v<typename decltype(ty)::X, X>) return f(ty);
    else return cudaErrorInvalidValue;
  });
}
// The forward (forward.cuh), plain or gated (forward_gated_<rows>.cu: x fp32).
template <class X, bool GATED, Rows R> cudaError_t forward_x(const ForwardArgs& args, cudaStream_t stream);
// The register-only backward (backward.cuh), plain or gated (backward_gated_<rows>.cu: x fp32): its grid size for these args,
// and its launch on that grid.
template <class X, bool GATED, Rows R> int registers_blocks_x(const BackwardArgs& args);
template <class X, bool GATED, Rows R> cudaError_t registers_backward_x(const BackwardArgs& args, int blocks, cudaStream_t stream);
// The persistent backward (backward_pipe.cuh) for 16-bit x, at LEAN's hidden sizes or the others
// (backward_pipe_<x>[_lean].cu): its grid size for these args (0: it does not run them), and its launch.
inline bool pipe_lean(int hidden) { return hidden > 512 && hidden <= 4096; }
template <class X, bool LEAN> int pipe_blocks_x(const BackwardArgs& args);
template <class X, bool LEAN> cudaError_t pipe_backward_x(const BackwardArgs& args, int blocks, cudaStream_t stream);

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
