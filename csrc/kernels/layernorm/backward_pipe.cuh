// Backward, persistent "pipe" kernel (instantiated per 16-bit x dtype, LEAN or not, in backward_pipe_<x>[_lean].cu;
// backward.cu picks the instantiation):
// same math and dw/db partials as the register-only kernel (backward.cuh), but dy, h, dh and the row's mean/rstd of
// the next STAGES-1 row groups are already on their way into shared memory (cp.async) while this group is reduced
// and written. A register-only kernel has one row's loads in flight per thread and waits on two block
// barriers per row with nothing outstanding.
#pragma once
#include <type_traits>

#include "pipeline.cuh"
#include "rows.cuh"

namespace tk_layernorm {
namespace {

constexpr int kDy = 0, kH = 1, kDh = 2, kDyMore = 3;  // staged operands (dy_more[j] in slot kDyMore + j)
constexpr int kStages = 3;               // 3 to 8 stages measured equal (H200)

// Operand slots a call stages: dy and h, then dh, then the dy_more present (an absent dh keeps its slot then).
// more = false: the caller knows there is no dy_more.
__host__ __device__ inline int staged_ops(const BackwardArgs& a, bool more = true) {
  if (more && a.dy_more[1]) return kDyMore + 2;
  if (more && a.dy_more[0]) return kDyMore + 1;
  return a.dh ? 3 : 2;
}

// Registers for 512 resident threads per SM (<= 128 per thread).
template <class S>
constexpr int kMinBlocks = S::BLOCK < 512 ? 512 / S::BLOCK : 1;

template <class Ty>
constexpr int kChunks = (sizeof(typename Ty::Y) == 4 || sizeof(typename Ty::H) == 4 || sizeof(typename Ty::W) == 4) ? 2 : 1;

// KEEP (at most 2 vectors per thread): the row's dy and x̂ stay in registers from the row sums to the second
// pass, instead of being read from shared memory and unpacked again, and w lives in fp32 registers. (Keeping
// g = dy·w instead and summing dw/db in the first pass cut the instructions further, ~14 per element against
// ~23, but ran 4% slower at hidden 8192 on the H200.)
// LEAN (with KEEP): the first row groups' copies are issued before w is loaded (w's load no longer delays them),
// one lane per warp copies the row's mean and rstd and shuffles them to the others (a 4-byte cp.async per thread
// was a quarter of the copies), the staging has no w area, and dres / dx are stored evict-first (st.global.cs).
// H200, hidden 1024, per call: w after the copies -1.1 us, statistics by one lane -1.4 us, evict-first stores
// -0.7 us (2 blocks per SM, without the dropout code).
// EXTRAS = false (LEAN only): launched only without dropout and without dy_more; the kernel has no code for either
// (never taken, the dropout code cost 2% at hidden 1024, the dy_more code 3-6% at hidden 1024-4096).
template <class Ty, class S, bool KEEP = false, bool LEAN = false, bool EXTRAS = true>
__global__ void __launch_bounds__(S::BLOCK, (kMinBlocks<S>)) backward_pipe_kernel(BackwardArgs a) {
  using H = typename Ty::H;
  using W = typename Ty::W;
  using Y = typename Ty::Y;
  constexpr int STAGES = kStages;
  static_assert(!KEEP || S::VECS <= 2, "KEEP holds w, dy and x̂ (3 x 8 floats per vector) in registers");
  static_assert(!LEAN || KEEP, "LEAN keeps w in registers");
  tk::grid::wait_prior_grid();  // launched by launch_dependent
  extern __shared__ uint4 staging_smem[];
  __shared__ float2 red[S::BLOCK / 32];
  const int lane = threadIdx.x % S::TPR;
  const int nvec = a.hidden / 8;
  const float inv_n = 1.f / float(a.hidden);
  const Y* dy_g = static_cast<const Y*>(a.dy);
  const H* h_g = static_cast<const H*>(a.h);
  const H* dh_g = static_cast<const H*>(a.dh);
  const bool has_w = a.weight != nullptr;
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};
  const Staging<kChunks<Ty>, S, STAGES, true, !LEAN> st{staging_smem, staged_ops(a, EXTRAS)};
  const Y* dy_more[2] = {EXTRAS ? static_cast<const Y*>(a.dy_more[0]) : nullptr,
                         EXTRAS ? static_cast<const Y*>(a.dy_more[1]) : nullptr};
  // The row's dy: the staged dy plus the staged dy_more, in fp32.
  const auto read_dy = [&](float (&dy)[8], int stage, int v) {
    unpack(dy, st.template read<Y>(stage, kDy, v));
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (dy_more[j]) {
        float more[8];
        unpack(more, st.template read<Y>(stage, kDyMore + j, v));
#pragma unroll
        for (int i = 0; i < 8; ++i) dy[i] += more[i];
      }
    }
  };

  // w is the same for every row this thread sees: copied once into the thread's fixed slot (it lands
  // with the first commit group), or with KEEP loaded once into registers.
  float wk[S::VECS][8];
  const auto load_w = [&] {
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      if constexpr (KEEP) {
        if (has_w && vi < nvec) unpack(wk[v], load_pack(static_cast<const W*>(a.weight) + vi * 8));
      } else {
        if (has_w && vi < nvec) st.copy_fixed(v, static_cast<const W*>(a.weight) + vi * 8);
      }
    }
  };
  if constexpr (!LEAN) load_w();
  float acc_w[S::VECS][8], acc_b[S::VECS][8];
#pragma unroll
  for (int v = 0; v < S::VECS; ++v)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_w[v][i] = acc_b[v][i] = 0.f;

  const int rows = int(a.rows);
  const auto [iters, step, first] = row_walk<S>(rows);
  int row = first;    // this iteration's row
  int ahead = first;  // the row the next issue loads
  // One commit group per iteration, empty past the end, so wait_group counts stay uniform.
  const auto issue = [&](int stage) {
    if (ahead < rows) {
      const int64_t base = int64_t(ahead) * a.hidden;
#pragma unroll
      for (int v = 0; v < S::VECS; ++v) {
        const int vi = v * S::TPR + lane;
        if (vi < nvec) {
          st.copy(stage, kDy, v, dy_g + base + vi * 8);
          st.copy(stage, kH, v, h_g + base + vi * 8);
          if (dh_g) st.copy(stage, kDh, v, dh_g + base + vi * 8);
#pragma unroll
          for (int j = 0; j < 2; ++j)
            if (dy_more[j]) st.copy(stage, kDyMore + j, v, dy_more[j] + base + vi * 8);
        }
      }
      if (!LEAN || threadIdx.x % 32 == 0) {
        if (a.mean) st.copy_stat(stage, 0, a.mean + ahead);
        st.copy_stat(stage, 1, a.rstd + ahead);
      }
    }
    cp_async_commit();
    ahead += step;
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  if constexpr (LEAN) load_w();
  int stage = 0;
#pragma unroll 1
  for (int it = 0; it < iters; ++it, row += step) {
    // Refill the stage read in the previous iteration (only this thread reads its slots: no barrier).
    issue(stage == 0 ? STAGES - 1 : stage - 1);
    cp_async_wait<STAGES - 1>();  // this iteration's group has landed
    const bool live = row < rows;
    const int64_t base = int64_t(row) * a.hidden;
    float mean = 0.f, rstd = 0.f;
    if constexpr (LEAN) {  // a row is whole warps: lane 0 holds the warp's row statistics
      if (threadIdx.x % 32 == 0 && live) {
        if (a.mean) mean = st.read_stat(stage, 0);
        rstd = st.read_stat(stage, 1);
      }
      mean = __shfl_sync(0xffffffffu, mean, 0);
      rstd = __shfl_sync(0xffffffffu, rstd, 0);
    } else {
      mean = live && a.mean ? st.read_stat(stage, 0) : 0.f;
      rstd = live ? st.read_stat(stage, 1) : 0.f;
    }
    float sg = 0.f, sgx = 0.f;
    float dyk[S::VECS][8], xk[S::VECS][8];  // KEEP: the row's dy and x̂
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      if (live && vi < nvec) {
        if constexpr (KEEP) {
          read_dy(dyk[v], stage, v);
          unpack(xk[v], st.template read<H>(stage, kH, v));
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            xk[v][i] = fmaf(xk[v][i], rstd, -mean * rstd);  // one FMA: (h - mean)·rstd up to rounding
            const float g = has_w ? dyk[v][i] * wk[v][i] : dyk[v][i];
            sg += g;
            sgx += g * xk[v][i];
          }
        } else {
          float dy[8], xh[8], wv[8];
          read_dy(dy, stage, v);
          unpack(xh, st.template read<H>(stage, kH, v));
          if (has_w) unpack(wv, st.template read_fixed<W>(v));
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float g = has_w ? dy[i] * wv[i] : dy[i];
            sg += g;
            sgx += g * ((xh[i] - mean) * rstd);
          }
        }
      }
    }
    const float2 sums = row_sum2<S>(sg, sgx, red);
    const float mean_g = a.rms ? 0.f : sums.x * inv_n;
    const float mean_gx = sums.y * inv_n;
    if (live) {
      // Without KEEP the row is read from shared memory again: the registers hold dw/db.
#pragma unroll
      for (int v = 0; v < S::VECS; ++v) {
        const int vi = v * S::TPR + lane;
        if (vi >= nvec) continue;
        if constexpr (KEEP) {
          float dres[8];
          if (dh_g) unpack(dres, st.template read<H>(stage, kDh, v));
          backward_vec_xhat<Ty, LEAN, EXTRAS>(a, drop, base, vi, dyk[v], xk[v], wk[v], has_w, dres, dh_g != nullptr,
                                               rstd, mean_g, mean_gx, acc_w[v], acc_b[v]);
          continue;
        }
        float dy[8], xh[8], wv[8], dres[8];
        read_dy(dy, stage, v);
        unpack(xh, st.template read<H>(stage, kH, v));
        if (has_w) unpack(wv, st.template read_fixed<W>(v));
        if (dh_g) unpack(dres, st.template read<H>(stage, kDh, v));
        backward_vec<Ty>(a, drop, base, vi, dy, xh, wv, has_w, dres, dh_g != nullptr, mean, rstd, mean_g, mean_gx,
                        acc_w[v], acc_b[v]);
      }
    }
    stage = stage + 1 == STAGES ? 0 : stage + 1;
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

template <class Ty, class S, bool LEAN>
size_t staging_bytes(const BackwardArgs& args) {
  constexpr size_t floor = S::ROWS > 1 ? size_t(S::MAX_HIDDEN) * sizeof(float) : 0;  // write_partial's sums
  const size_t bytes = Staging<kChunks<Ty>, S, kStages, true, !LEAN>::bytes(staged_ops(args));
  return bytes > floor ? bytes : floor;
}

// f(kernel, smem bytes, block, rows per block) for one instantiation: KEEP where the block has at most 512 threads
// (past hidden 8192 a block has 1024 threads, so 64 registers, and the kept row would spill). per_sm > 0: the
// shared memory is padded so that at most per_sm blocks are resident on an SM. LEAN: the kernel without the dropout
// and dy_more code (EXTRAS = false) runs the calls that have neither.
template <class Ty, class S, bool LEAN, typename F>
cudaError_t pick(const BackwardArgs& args, F&& f, int per_sm = 0) {
  constexpr bool KEEP = S::BLOCK <= 512;
  size_t smem = staging_bytes<Ty, S, LEAN>(args);
  if (per_sm > 0) smem = smem_for_residency(smem, per_sm);
  if constexpr (LEAN) {
    static_assert(KEEP, "LEAN keeps w in registers");
    if (!args.dropout.enabled && !args.dy_more[0])
      return f(backward_pipe_kernel<Ty, S, KEEP, LEAN, false>, smem, S::BLOCK, S::ROWS);
  }
  return f(backward_pipe_kernel<Ty, S, KEEP, LEAN>, smem, S::BLOCK, S::ROWS);
}

// The persistent kernel's splits: two vectors per thread (its data waits in shared memory, not registers: fewer
// threads per row, cheaper row sums, more dw/db registers) in blocks of at least 128 threads (two rows of 64 at
// hidden 1024, 4 blocks per SM), which even out the SMs' share of rows better than larger blocks (H200: 83 -> 85%
// of copy at 1024, 89 -> 91% at 2048). LEAN at hidden 513..4096 with at most 256 resident threads per SM (two
// 128-thread blocks at hidden <= 2048): on the H200 at hidden 1024 the grid moved its bytes faster with 2 blocks
// per SM than with 3 or 4, and its column sum has half the rows (86 -> 91% of copy at 1024, 91 -> 95-97% at 2048
// and 4096). It ran 1-2% slower than plain KEEP at hidden 8192, and was never timed at 512 and below.
// f(Split, std::bool_constant<LEAN>).

template <bool LEAN, typename F>
cudaError_t with_pipe_split(int hidden, F&& f) {
  using std::bool_constant;
  if constexpr (LEAN) {
    if (!pipe_lean(hidden)) return cudaErrorInvalidValue;
    if (hidden <= 1024) return f(Split<64, 2, 128>{}, bool_constant<true>{});
    if (hidden <= 2048) return f(Split<128, 2, 128>{}, bool_constant<true>{});
    return f(Split<256, 2, 128>{}, bool_constant<true>{});
  } else {
    if (hidden <= 256) return f(Split<32, 1, 128>{}, bool_constant<false>{});
    if (hidden <= 512) return f(Split<32, 2, 128>{}, bool_constant<false>{});
    if (hidden <= 4096) return cudaErrorInvalidValue;  // LEAN's
    if (hidden <= 8192) return f(Split<512, 2, 128>{}, bool_constant<false>{});
    if (hidden <= kMaxHidden) return f(Split<1024, 2, 128>{}, bool_constant<false>{});
    return cudaErrorInvalidValue;
  }
}

// f(kernel, smem bytes, block, rows per block) for the call's instantiation with x of type X.
// fp32 rows (h) are not staged: the register-only kernel (backward.cuh) runs them 1.1-1.7x faster on the H200
// (bf16 branch and fp32 residual stream of autocast at hidden 1024-4096, fp32 throughout at 2048).
template <class X, bool LEAN, typename F>
cudaError_t with_kernel(const BackwardArgs& args, F&& f) {
  return with_x_types<X>(args.dtypes, [&](auto ty) {
    if constexpr (std::is_same_v<typename decltype(ty)::H, float>) return cudaErrorNotSupported;
    else return with_pipe_split<LEAN>(args.hidden, [&](auto s, auto lean) {
      using S = decltype(s);
      return pick<decltype(ty), S, decltype(lean)::value>(args, f, lean ? (S::BLOCK < 256 ? 256 / S::BLOCK : 1) : 0);
    });
  });
}

}  // namespace

template <class X, bool LEAN>
int pipe_blocks_x(const BackwardArgs& args) {
  int blocks = 0;
  with_kernel<X, LEAN>(args, [&](auto kernel, size_t smem, int block, int rows_per_block) {
    blocks = persistent_grid<kStages>(kernel, block, smem, args.rows, rows_per_block);
    return cudaSuccess;
  });
  return blocks;
}

template <class X, bool LEAN>
cudaError_t pipe_backward_x(const BackwardArgs& args, int blocks, cudaStream_t stream) {
  return with_kernel<X, LEAN>(args, [&](auto kernel, size_t smem, int block, int) {
    return tk::grid::launch_dependent(kernel, blocks, block, smem, stream, args);
  });
}

}  // namespace tk_layernorm
