// Forward: h = residual + dropout(x), y = norm(h)·w + b, with fp32 statistics kept for the backward.
// One pass over HBM: the row stays in registers between the reductions and the normalisation.
// This file holds the legacy variant (a block per ROWS rows, statistics inline: moving them into
// row_stats made ptxas spill at 64 registers), its one-row-per-block splits (variants 4, 5, 7) and the
// dispatcher; forward_pipe.cu the others.
#include <type_traits>

#include "rows.cuh"

namespace tk_layernorm {
namespace {

// At least 1024 resident threads per SM (registers <= 64; 512 for fp32 rows): enough rows in flight to
// cover HBM latency. EARLY (variant 8): the order of torch.compile's kernel at hidden 1024: w and b are loaded with
// x and the residual, so the row does not wait on a second round trip after its statistics, and h is stored with
// y at the end; 640 threads per SM (<= 102 registers; fp32: 384) hold w and b. (H200, hidden 1024: variant 5
// 129.0 us, 5 with EARLY 128.5, torch.compile 127.6; 7 with EARLY, Inductor's split, 130.5 against 7's 130.2.)
template <typename T, class S, bool EARLY>
constexpr int fwd_min_blocks() {
  constexpr int threads = sizeof(T) == 4 ? (EARLY ? 384 : 512) : (EARLY ? 640 : 1024);
  return threads / S::BLOCK > 0 ? threads / S::BLOCK : 1;
}

template <typename T, class S, bool EARLY = false>
__global__ void __launch_bounds__(S::BLOCK, (fwd_min_blocks<T, S, EARLY>())) forward_kernel(ForwardArgs a) {
  tk::grid::wait_prior_grid();  // launched by launch_dependent
  __shared__ float smem[S::BLOCK / 32];
  const int lane = threadIdx.x % S::TPR;
  const int64_t row = int64_t(blockIdx.x) * S::ROWS + threadIdx.x / S::TPR;
  const bool live = row < a.rows;  // no early return: row_sum synchronises the block
  const int nvec = a.hidden / 8;
  const int64_t base = row * a.hidden;
  const T* x = static_cast<const T*>(a.x) + base;
  const T* res = a.residual ? static_cast<const T*>(a.residual) + base : nullptr;
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};

  // Issue every load of the row before any store: stores to h could alias the inputs as far as the
  // compiler knows, so interleaving them would serialise the loads (one vector in flight at a time).
  Pack8<T> xr[S::VECS], rr[S::VECS];
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (live && vi < nvec) {
      xr[v] = load_pack(x + vi * 8);
      if (res) rr[v] = load_pack(res + vi * 8);
    }
  }
  const T* w = static_cast<const T*>(a.weight);
  const T* b = static_cast<const T*>(a.bias);
  Pack8<T> wr[S::VECS], br[S::VECS];
  if constexpr (EARLY) load_wb<T, S>(wr, br, w, b, lane, nvec);
  // The row lives in registers as T (half the registers of fp32 for 16-bit types); h is rounded to T
  // anyway, so unpacking it again below is exact.
  Pack8<T> hp[S::VECS];
  float sum = 0.f;
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    float h[8];
    if (live && vi < nvec) {
      // Statistics of the h that is stored and that eager would normalise: rounded to T.
      hp[v] = make_h(xr[v], rr[v], res != nullptr, drop, a.dropout.enabled, uint64_t(base) + uint64_t(vi) * 8);
      unpack(h, hp[v]);
      if (!EARLY && (res || a.dropout.enabled)) store_pack(static_cast<T*>(a.h) + base + vi * 8, hp[v]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) h[i] = 0.f;
      hp[v] = pack<T>(h);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += h[i];
  }

  const float inv_n = 1.f / float(a.hidden);
  float mean = 0.f, sq = 0.f;
  if (!a.rms) {
    mean = row_sum<S>(sum, smem) * inv_n;
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      if (v * S::TPR + lane < nvec) {
        float h[8];
        unpack(h, hp[v]);
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += (h[i] - mean) * (h[i] - mean);
      }
    }
  } else {
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      float h[8];
      unpack(h, hp[v]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sq += h[i] * h[i];
    }
  }
  const float rstd = rsqrtf(row_sum<S>(sq, smem) * inv_n + a.eps);
  if (!live) return;  // no block-wide sync below
  if (lane == 0 && a.rstd) {  // nullptr: inference, no statistics kept
    a.rstd[row] = rstd;
    if (a.mean) a.mean[row] = mean;
  }

  T* y = static_cast<T*>(a.y) + base;
  if constexpr (!EARLY) load_wb<T, S>(wr, br, w, b, lane, nvec);
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (vi >= nvec) continue;
    if (EARLY && (res || a.dropout.enabled)) store_pack(static_cast<T*>(a.h) + base + vi * 8, hp[v]);
    float out[8];
    norm_vec(out, hp[v], mean, rstd, wr[v], w != nullptr, br[v], b != nullptr);
    store8(y + vi * 8, out);
  }
}

}  // namespace

cudaError_t forward(const ForwardArgs& args, DType dtype, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 8 || args.hidden > kMaxHidden || args.rows < 0) return cudaErrorInvalidValue;
  if (args.rows == 0) return cudaSuccess;
  if (args.variant < 0 || args.variant >= kForwardVariants) return cudaErrorInvalidValue;
  if (args.variant == 1 || args.variant == 2 || args.variant == 3 || args.variant == 6) {
    const cudaError_t err = pipe::forward(args, dtype, stream);
    if (err != cudaErrorNotSupported) return err;
  }
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const auto launch_as = [&](auto s, auto early) {
      using S = decltype(s);
      const int64_t blocks = (args.rows + S::ROWS - 1) / S::ROWS;
      if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
      return tk::grid::launch_dependent(forward_kernel<T, S, decltype(early)::value>, unsigned(blocks), S::BLOCK, 0,
                                        stream, args);
    };
    const auto launch = [&](auto s) { return launch_as(s, std::false_type{}); };
    // 4, 5: the same kernel, one row per block (1 or 2 vectors per thread). 7: the legacy split, one row per
    // block (a warp per block up to hidden 1024: a block's slot frees as soon as its row is done).
    if (args.variant == 4) return with_row_split<1>(args.hidden, launch);
    if (args.variant == 5) return with_row_split<2>(args.hidden, launch);
    if (args.variant == 7) return with_split<false, 32>(args.hidden, launch);
    // 8: 5 with w and b loaded early and h stored last (EARLY) where its block has at most 64 threads (hidden
    // <= 1024). H200, inference forward: 1024 4082 GB/s against 5's 4061 (torch.compile 4065); 2048 4152 against
    // 4163; a 512-thread block holding w and b needs more than 64 registers, so one block per SM (8192: 1.59 ms
    // against 1.03).
    if (args.variant == 8)
      return with_row_split<2>(args.hidden, [&](auto s) {
        return launch_as(s, std::bool_constant<(decltype(s)::BLOCK <= 64)>{});
      });
    return with_split<false>(args.hidden, launch);
  });
}

}  // namespace tk_layernorm
