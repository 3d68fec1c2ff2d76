// Backward, persistent "pipe" kernel (instantiated by backward_pipe.cu and backward_pipe_wide.cu): same math
// and dw/db partials as the legacy kernel (backward.cu), but dy, h, dh and the row's mean/rstd of the next
// STAGES-1 row groups are already on their way into shared memory (cp.async) while this group is reduced
// and written. The legacy kernel had one row's loads in flight per thread and waited on two block
// barriers per row with nothing outstanding.
#pragma once
#include <type_traits>

#include "pipeline.cuh"
#include "rows.cuh"

namespace tk_layernorm {
namespace {

constexpr int kDy = 0, kH = 1, kDh = 2;  // staged operands

// THREADS: resident threads per SM the register budget is set for (1024: <= 64 registers, where ptxas
// spills a few words; 768: <= 80; 512: <= 128).
template <int THREADS, class S>
constexpr int kMinBlocks = S::BLOCK < THREADS ? THREADS / S::BLOCK : 1;

// NAMED: the row sums wait on their row group's barrier only, not the block's (variant 6).
// KEEP (variants 7, 8; at most 2 vectors per thread): the first pass also sums dw/db and leaves g = dy·w
// and x̂ in registers, so the second pass is two FMAs and an add per element, where it read dy, h and w
// from shared memory again and unpacked them. w lives in fp32 registers (1 when absent: no selects).
// TAIL (variant 9, with KEEP): the block takes a.static_iters row groups in the fixed order, then tail chunks
// of a.chunk_groups groups by drawing their numbers from a.counters[0]. Each chunk (and each block's fixed
// part) sums into its own partial row, so which block runs a chunk does not change the result; the last
// block to finish zeroes the counters for the next launch on the stream.
template <typename T, class S, int STAGES, int THREADS, bool NAMED = false, bool KEEP = false, bool TAIL = false>
__global__ void __launch_bounds__(S::BLOCK, (kMinBlocks<THREADS, S>)) backward_pipe_kernel(BackwardArgs a) {
  static_assert(!KEEP || S::VECS <= 2, "KEEP holds w, g and x̂ (3 x 8 floats per vector) in registers");
  static_assert(!TAIL || KEEP, "the tail flushes partials mid-loop: only the KEEP loop does that");
  extern __shared__ uint4 staging_smem[];
  __shared__ float2 red[S::BLOCK / 32];
  const int lane = threadIdx.x % S::TPR;
  const int nvec = a.hidden / 8;
  const float inv_n = 1.f / float(a.hidden);
  const T* dy_g = static_cast<const T*>(a.dy);
  const T* h_g = static_cast<const T*>(a.h);
  const T* dh_g = static_cast<const T*>(a.dh);
  const bool has_w = a.weight != nullptr;
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};
  const Staging<T, S, STAGES, true> st{staging_smem, dh_g ? 3 : 2};

  // w is the same for every row this thread sees: copied once into the thread's fixed slot (it lands
  // with the first commit group), or with KEEP loaded once into registers.
  float wk[S::VECS][8];
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if constexpr (KEEP) {
      if (has_w && vi < nvec) {
        unpack(wk[v], load_pack(static_cast<const T*>(a.weight) + vi * 8));
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) wk[v][i] = 1.f;
      }
    } else {
      if (has_w && vi < nvec) st.copy_fixed(v, static_cast<const T*>(a.weight) + vi * 8);
    }
  }
  float acc_w[S::VECS][8], acc_b[S::VECS][8];
#pragma unroll
  for (int v = 0; v < S::VECS; ++v)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_w[v][i] = acc_b[v][i] = 0.f;

  const int rows = int(a.rows);
  const auto [iters, step, first] = row_walk<S>(rows);
  int row = first;    // this iteration's row
  int ahead = first;  // the row the next issue loads
  // TAIL: the issue side's position, and the numbers of its current and previous tail chunk (-1: none yet;
  // >= tail_chunks: none left). The compute side trails by STAGES - 1 positions, at most one chunk.
  __shared__ int drawn[2];
  const int rg = int(threadIdx.x) / S::TPR;
  const int tail_start = a.static_iters * int(gridDim.x);
  int ka = 0, chunk_cur = -1, chunk_prev = -1;
  // One commit group per iteration, empty past the end, so wait_group counts stay uniform.
  const auto issue = [&](int stage) {
    if constexpr (TAIL) {
      if (ka < a.static_iters) {
        ahead = (int(blockIdx.x) + ka * int(gridDim.x)) * S::ROWS + rg;
      } else {
        const int t = ka - a.static_iters;
        if (t % a.chunk_groups == 0) {  // a new chunk (block-uniform)
          chunk_prev = chunk_cur;
          if (chunk_cur < a.tail_chunks) {
            if (threadIdx.x == 0) drawn[(t / a.chunk_groups) & 1] = atomicAdd(a.counters, 1);
            __syncthreads();  // double-buffered: the next draw is a chunk later, past other barriers
            chunk_cur = drawn[(t / a.chunk_groups) & 1];
          }
        }
        ahead = chunk_cur < a.tail_chunks ? (tail_start + chunk_cur * a.chunk_groups + t % a.chunk_groups) * S::ROWS + rg
                                          : rows;
      }
      ++ka;
    }
    if (ahead < rows) {
      const int64_t base = int64_t(ahead) * a.hidden;
#pragma unroll
      for (int v = 0; v < S::VECS; ++v) {
        const int vi = v * S::TPR + lane;
        if (vi < nvec) {
          st.copy(stage, kDy, v, dy_g + base + vi * 8);
          st.copy(stage, kH, v, h_g + base + vi * 8);
          if (dh_g) st.copy(stage, kDh, v, dh_g + base + vi * 8);
        }
      }
      if (a.mean) st.copy_stat(stage, 0, a.mean + ahead);
      st.copy_stat(stage, 1, a.rstd + ahead);
    }
    cp_async_commit();
    if constexpr (!TAIL) ahead += step;
  };
  // TAIL: this block's partial row `slot` gets the accumulators, which restart from zero.
  float* flush_smem = reinterpret_cast<float*>(reinterpret_cast<char*>(staging_smem) +
                                               Staging<T, S, STAGES, true>::bytes(dh_g ? 3 : 2));
  const auto flush = [&](int slot) {
    const int64_t stride = int64_t(a.partial_rows) * a.hidden;
    if (a.dw) write_partial<S>(acc_w, a.partial + int64_t(slot) * a.hidden, a.hidden, flush_smem);
    if (a.db) write_partial<S>(acc_b, a.partial + stride + int64_t(slot) * a.hidden, a.hidden, flush_smem);
#pragma unroll
    for (int v = 0; v < S::VECS; ++v)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc_w[v][i] = acc_b[v][i] = 0.f;
  };
  if constexpr (TAIL) {
    if (a.static_iters == 0) flush(int(blockIdx.x));  // no fixed part: its row is zero
  }

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  int stage = 0;
#pragma unroll 1
  for (int it = 0; TAIL || it < iters; ++it, row += step) {
    // Refill the stage read in the previous iteration (only this thread reads its slots: no barrier).
    issue(stage == 0 ? STAGES - 1 : stage - 1);
    cp_async_wait<STAGES - 1>();  // this iteration's group has landed
    int t = 0, chunk = 0;  // TAIL: position in the tail and the chunk number of this iteration's row
    if constexpr (TAIL) {
      if (it < a.static_iters) {
        row = (int(blockIdx.x) + it * int(gridDim.x)) * S::ROWS + rg;
      } else {
        t = it - a.static_iters;
        const bool same = (it + STAGES - 1 - a.static_iters) / a.chunk_groups == t / a.chunk_groups;
        chunk = same ? chunk_cur : chunk_prev;
        if (chunk >= a.tail_chunks) break;  // block-uniform
        row = (tail_start + chunk * a.chunk_groups + t % a.chunk_groups) * S::ROWS + rg;
      }
    }
    const bool live = row < rows;
    const int64_t base = int64_t(row) * a.hidden;
    const float mean = live && a.mean ? st.read_stat(stage, 0) : 0.f;
    const float rstd = live ? st.read_stat(stage, 1) : 0.f;
    float sg = 0.f, sgx = 0.f;
    float gk[S::VECS][8], xk[S::VECS][8];  // KEEP: the row's g = dy·w and x̂
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      if (live && vi < nvec) {
        if constexpr (KEEP) {
          float dy[8];
          unpack(dy, st.read(stage, kDy, v));
          unpack(xk[v], st.read(stage, kH, v));
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            xk[v][i] = fmaf(xk[v][i], rstd, -mean * rstd);  // one FMA: (h - mean)·rstd up to rounding
            gk[v][i] = dy[i] * wk[v][i];
            sg += gk[v][i];
            sgx += gk[v][i] * xk[v][i];
            acc_w[v][i] += dy[i] * xk[v][i];
            acc_b[v][i] += dy[i];
          }
        } else {
          float dy[8], xh[8], wv[8];
          unpack(dy, st.read(stage, kDy, v));
          unpack(xh, st.read(stage, kH, v));
          if (has_w) unpack(wv, st.read_fixed(v));
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float g = has_w ? dy[i] * wv[i] : dy[i];
            sg += g;
            sgx += g * ((xh[i] - mean) * rstd);
          }
        }
      }
    }
    const float2 sums = row_sum2<S, NAMED>(sg, sgx, red);
    const float mean_g = a.rms ? 0.f : sums.x * inv_n;
    const float mean_gx = sums.y * inv_n;
    const float c_0 = -rstd * mean_g, c_x = -rstd * mean_gx;  // KEEP: dn = rstd·g + c_0 + x̂·c_x
    if (live) {
      // Without KEEP the row is read from shared memory again: the registers hold dw/db.
#pragma unroll
      for (int v = 0; v < S::VECS; ++v) {
        const int vi = v * S::TPR + lane;
        if (vi >= nvec) continue;
        if constexpr (KEEP) {
          float dres[8];
          if (dh_g) {  // a uniform branch, not a select per element
            unpack(dres, st.read(stage, kDh, v));
#pragma unroll
            for (int i = 0; i < 8; ++i) dres[i] += fmaf(gk[v][i], rstd, fmaf(xk[v][i], c_x, c_0));
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) dres[i] = fmaf(gk[v][i], rstd, fmaf(xk[v][i], c_x, c_0));
          }
          store_grads<T>(a, drop, base, vi, dres);
          continue;
        }
        float dy[8], xh[8], wv[8], dres[8];
        unpack(dy, st.read(stage, kDy, v));
        unpack(xh, st.read(stage, kH, v));
        if (has_w) unpack(wv, st.read_fixed(v));
        if (dh_g) unpack(dres, st.read(stage, kDh, v));
        backward_vec<T>(a, drop, base, vi, dy, xh, wv, has_w, dres, dh_g != nullptr, mean, rstd, mean_g, mean_gx,
                        acc_w[v], acc_b[v]);
      }
    }
    stage = stage + 1 == STAGES ? 0 : stage + 1;
    if constexpr (TAIL) {
      if (it == a.static_iters - 1) {
        flush(int(blockIdx.x));
      } else if (it >= a.static_iters && t % a.chunk_groups == a.chunk_groups - 1) {
        flush(int(gridDim.x) + chunk);
      }
    }
  }

  if constexpr (TAIL) {
    // Every chunk is flushed. The counters go back to zero once every block has drawn its last number.
    cp_async_wait<0>();
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(a.counters + 1, 1) == int(gridDim.x) - 1) {
        a.counters[0] = 0;
        a.counters[1] = 0;
      }
    }
    return;
  }
  // The staging area sums the row groups' partials now: every copy must have landed (only empty groups
  // can be pending) and every thread be done reading its slots.
  cp_async_wait<0>();
  __syncthreads();
  float* acc_smem = reinterpret_cast<float*>(staging_smem);  // >= S::MAX_HIDDEN floats (Staging::bytes)
  const int64_t stride = int64_t(gridDim.x) * a.hidden;
  if (a.dw) write_partial<S>(acc_w, a.partial + int64_t(blockIdx.x) * a.hidden, a.hidden, acc_smem);
  if (a.db) write_partial<S>(acc_b, a.partial + stride + int64_t(blockIdx.x) * a.hidden, a.hidden, acc_smem);
}

// TAIL: write_partial's sums get their own area after the staging (the staging is busy when a chunk ends).
template <typename T, class S, int STAGES, bool TAIL = false>
size_t staging_bytes(const BackwardArgs& args) {
  constexpr size_t floor = S::ROWS > 1 ? size_t(S::MAX_HIDDEN) * sizeof(float) : 0;  // write_partial's sums
  const size_t bytes = Staging<T, S, STAGES, true>::bytes(args.dh ? 3 : 2);
  if constexpr (TAIL) return bytes + floor;
  return bytes > floor ? bytes : floor;
}

// f(kernel, smem bytes, block, rows per block, stages) for one instantiation.
template <typename T, class S, int STAGES, int THREADS, bool NAMED, bool KEEP = false, bool TAIL = false, typename F>
cudaError_t pick(const BackwardArgs& args, F&& f) {
  return f(backward_pipe_kernel<T, S, STAGES, THREADS, NAMED, KEEP, TAIL>, staging_bytes<T, S, STAGES, TAIL>(args),
           S::BLOCK, S::ROWS, std::integral_constant<int, STAGES>{});
}

// The balanced tail's plan (variant 9) for a grid of `blocks`: 7/8 of the row groups in the fixed order, the
// rest in chunks of at least 16 rows (a partial row per chunk costs 2 / 16 of its bytes) and of at least
// STAGES - 1 groups (the compute side then trails the issue side by at most one chunk).
inline void plan_tail(BackwardArgs& a, int blocks, int rows_per_block, int stages) {
  const int64_t groups = (a.rows + rows_per_block - 1) / rows_per_block;
  const int per_chunk = (16 + rows_per_block - 1) / rows_per_block;
  a.chunk_groups = per_chunk > stages - 1 ? per_chunk : stages - 1;
  a.static_iters = int((groups - groups / 8) / blocks);
  const int64_t tail = groups - int64_t(a.static_iters) * blocks;
  a.tail_chunks = int((tail + a.chunk_groups - 1) / a.chunk_groups);
  a.partial_rows = blocks + a.tail_chunks;
}

}  // namespace

// Variants 4..9 (backward_pipe_wide.cu: a second file, so the build compiles them in parallel), for the
// hidden sizes where they differ from variant 3 (see effective_variant).
namespace pipe_wide {
int backward_blocks(const BackwardArgs& args, DType dtype);
int backward_partial_rows(const BackwardArgs& args, DType dtype);
cudaError_t backward(const BackwardArgs& args, DType dtype, int blocks, cudaStream_t stream);
}  // namespace pipe_wide

// 4, 5: past hidden 8192 a 512-thread block of 4 vectors would have 128 registers and spill. 6: up to 512
// a row is one warp (no barrier), past 2048 a block holds one row (row-group barriers are block barriers).
// 7-9: past 8192 a block has 1024 threads, so 64 registers, and the kept row would spill. Variant 3 runs there.
inline int effective_variant(const BackwardArgs& args) {
  if ((args.variant == 4 || args.variant == 5) && args.hidden > 8192) return 3;
  if (args.variant == 6 && (args.hidden <= 512 || args.hidden > 2048)) return 3;
  if ((args.variant == 7 || args.variant == 8 || args.variant == 9) && args.hidden > 8192) return 3;
  return args.variant;
}

}  // namespace tk_layernorm
