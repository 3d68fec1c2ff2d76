// Forward, persistent "pipe" variants (1, 2, 3, 6): each block loops over groups of ROWS rows, and the x /
// residual vectors of the next STAGES-1 groups are already on their way into shared memory (cp.async) while
// this group is reduced and written. Same math as the legacy kernel (rows.cuh).
#include "pipeline.cuh"
#include "rows.cuh"

namespace tk_layernorm {
namespace {

// Stage x (operand 0) and, when present, the residual (1) of the row starting at element `base`.
template <typename T, class S, int STAGES>
__device__ __forceinline__ void stage_row(const Staging<T, S, STAGES, false>& st, int stage, const T* x, const T* res,
                                          int64_t base, int lane, int nvec) {
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (vi < nvec) {
      st.copy(stage, 0, v, x + base + vi * 8);
      if (res) st.copy(stage, 1, v, res + base + vi * 8);
    }
  }
}

// At least 512 resident threads per SM (256 for fp32): with the data in shared memory that is plenty of
// bytes in flight, and the staging usually bounds occupancy first.
template <typename T, class S>
constexpr int kMinForwardBlocks = S::BLOCK < (sizeof(T) == 4 ? 256 : 512) ? (sizeof(T) == 4 ? 256 : 512) / S::BLOCK : 1;

template <typename T, class S, int STAGES>
__global__ void __launch_bounds__(S::BLOCK, (kMinForwardBlocks<T, S>)) forward_pipe_kernel(ForwardArgs a) {
  tk::grid::wait_prior_grid();  // launched by launch_dependent
  extern __shared__ uint4 staging_smem[];
  __shared__ float smem[S::BLOCK / 32];
  const int lane = threadIdx.x % S::TPR;
  const int nvec = a.hidden / 8;
  const T* x = static_cast<const T*>(a.x);
  const T* res = static_cast<const T*>(a.residual);
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};
  const Staging<T, S, STAGES, false> st{staging_smem, res ? 2 : 1};

  // w and b are the same for every row this thread sees: registers, loaded once.
  const T* w = static_cast<const T*>(a.weight);
  const T* b = static_cast<const T*>(a.bias);
  Pack8<T> wr[S::VECS], br[S::VECS];
  load_wb<T, S>(wr, br, w, b, lane, nvec);

  const int rows = int(a.rows);
  const auto [iters, step, first] = row_walk<S>(rows);
  // stage is declared before row: the other order renumbers the PTX registers and changes this kernel's SASS.
  int stage = 0;      // this iteration's stage
  int row = first;    // this iteration's row
  int ahead = first;  // the row the next issue loads
  // One commit group per iteration, empty past the end, so wait_group counts stay uniform.
  const auto issue = [&](int into) {
    if (ahead < rows) stage_row(st, into, x, res, int64_t(ahead) * a.hidden, lane, nvec);
    cp_async_commit();
    ahead += step;
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
#pragma unroll 1
  for (int it = 0; it < iters; ++it, row += step) {
    // Refill the stage read in the previous iteration (only this thread reads its slots: no barrier).
    issue(stage == 0 ? STAGES - 1 : stage - 1);
    cp_async_wait<STAGES - 1>();  // this iteration's group has landed
    const bool live = row < rows;
    const int64_t base = int64_t(row) * a.hidden;
    Pack8<T> hp[S::VECS];
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      hp[v] = Pack8<T>{};
      if (live && vi < nvec) {
        hp[v] = make_h(st.read(stage, 0, v), res ? st.read(stage, 1, v) : Pack8<T>{}, res != nullptr, drop,
                       a.dropout.enabled, uint64_t(base) + uint64_t(vi) * 8);
        if (res || a.dropout.enabled) store_pack(static_cast<T*>(a.h) + base + vi * 8, hp[v]);
      }
      float h[8];
      unpack(h, hp[v]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += h[i];
    }
    const float2 stats = row_stats<T, S>(hp, sum, lane, nvec, a.hidden, a.eps, a.rms, smem);
    if (live) {
      if (lane == 0 && a.rstd) {  // nullptr: inference, no statistics kept
        a.rstd[row] = stats.y;
        if (a.mean) a.mean[row] = stats.x;
      }
      T* y = static_cast<T*>(a.y) + base;
#pragma unroll
      for (int v = 0; v < S::VECS; ++v) {
        const int vi = v * S::TPR + lane;
        if (vi >= nvec) continue;
        float out[8];
        norm_vec(out, hp[v], stats.x, stats.y, wr[v], w != nullptr, br[v], b != nullptr);
        store8(y + vi * 8, out);
      }
    }
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
}

// Variant 6, "lean": the same pipeline, but the row never lives in registers. h is written back over x's
// slot and re-read for the variance and for y, and w / b are re-read per row (L1 hits), so the kernel fits
// 64 registers (1024 resident threads; 512 for fp32) at every split: at hidden 1024 the kernel above took
// 127 registers, 16 warps per SM against the legacy kernel's 32, and ran at 88% of copy against 92%.
// Two stages (32 KB per 128-thread block at hidden 1024 with a residual): 28 warps per SM; a third stage
// would let shared memory cap it at 16 again.
template <typename T, class S>
constexpr int kMinLeanBlocks = S::BLOCK < (sizeof(T) == 4 ? 512 : 1024) ? (sizeof(T) == 4 ? 512 : 1024) / S::BLOCK : 1;

template <typename T, class S, int STAGES>
__global__ void __launch_bounds__(S::BLOCK, (kMinLeanBlocks<T, S>)) forward_lean_kernel(ForwardArgs a) {
  tk::grid::wait_prior_grid();  // launched by launch_dependent
  extern __shared__ uint4 staging_smem[];
  __shared__ float smem[S::BLOCK / 32];
  const int lane = threadIdx.x % S::TPR;
  const int nvec = a.hidden / 8;
  const T* x = static_cast<const T*>(a.x);
  const T* res = static_cast<const T*>(a.residual);
  const T* w = static_cast<const T*>(a.weight);
  const T* b = static_cast<const T*>(a.bias);
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};
  const Staging<T, S, STAGES, false> st{staging_smem, res ? 2 : 1};
  const float inv_n = 1.f / float(a.hidden);

  const int rows = int(a.rows);
  const auto [iters, step, first] = row_walk<S>(rows);
  int row = first, ahead = first;
  const auto issue = [&](int stage) {
    if (ahead < rows) stage_row(st, stage, x, res, int64_t(ahead) * a.hidden, lane, nvec);
    cp_async_commit();
    ahead += step;
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  int stage = 0;
#pragma unroll 1
  for (int it = 0; it < iters; ++it, row += step) {
    issue(stage == 0 ? STAGES - 1 : stage - 1);
    cp_async_wait<STAGES - 1>();
    const bool live = row < rows;
    const int64_t base = int64_t(row) * a.hidden;
    // Pass 1: h (stored, and kept over x's slot: only this thread reads its slots), its sum.
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      if (live && vi < nvec) {
        const Pack8<T> hp = make_h(st.read(stage, 0, v), res ? st.read(stage, 1, v) : Pack8<T>{}, res != nullptr, drop,
                                   a.dropout.enabled, uint64_t(base) + uint64_t(vi) * 8);
        if (res || a.dropout.enabled) {
          store_pack(static_cast<T*>(a.h) + base + vi * 8, hp);
          st.write(stage, 0, v, hp);
        }
        float h[8];
        unpack(h, hp);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += h[i];
      }
    }
    // Pass 2: the centred sum of squares (the plain one for RMSNorm), from shared memory.
    const float mean = a.rms ? 0.f : row_sum<S>(sum, smem) * inv_n;
    float sq = 0.f;
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      if (live && vi < nvec) {
        float h[8];
        unpack(h, st.read(stage, 0, v));
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += (h[i] - mean) * (h[i] - mean);
      }
    }
    const float rstd = rsqrtf(row_sum<S>(sq, smem) * inv_n + a.eps);
    // Pass 3: y.
    if (live) {
      if (lane == 0 && a.rstd) {  // nullptr: inference, no statistics kept
        a.rstd[row] = rstd;
        if (a.mean) a.mean[row] = mean;
      }
      T* y = static_cast<T*>(a.y) + base;
#pragma unroll
      for (int v = 0; v < S::VECS; ++v) {
        const int vi = v * S::TPR + lane;
        if (vi >= nvec) continue;
        Pack8<T> wp, bp;
        if (w) wp = load_pack(w + vi * 8);
        if (b) bp = load_pack(b + vi * 8);
        float out[8];
        norm_vec(out, st.read(stage, 0, v), mean, rstd, wp, w != nullptr, bp, b != nullptr);
        store8(y + vi * 8, out);
      }
    }
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
}

template <typename T, class S, int STAGES, bool LEAN = false>
cudaError_t launch(const ForwardArgs& args, cudaStream_t stream) {
  const size_t smem = Staging<T, S, STAGES, false>::bytes(args.residual ? 2 : 1);
  const auto kernel = [] {
    if constexpr (LEAN) return forward_lean_kernel<T, S, STAGES>;
    else return forward_pipe_kernel<T, S, STAGES>;
  }();
  const int blocks = persistent_grid<STAGES>(kernel, S::BLOCK, smem, args.rows, S::ROWS);
  if (blocks == 0) return cudaErrorNotSupported;
  return tk::grid::launch_dependent(kernel, blocks, S::BLOCK, smem, stream, args);
}

}  // namespace

namespace pipe {

cudaError_t forward(const ForwardArgs& args, DType dtype, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return with_pipe_split<false, 1>(args.hidden, [&](auto s) {
      using S = decltype(s);
      switch (args.variant) {
        case 1: return launch<T, S, 2>(args, stream);
        case 2: return launch<T, S, 3>(args, stream);
        case 3: return launch<T, S, 4>(args, stream);
        case 6: return launch<T, S, 2, true>(args, stream);
        default: return cudaErrorInvalidValue;
      }
    });
  });
}

}  // namespace pipe
}  // namespace tk_layernorm
