// Forward: h = residual + dropout(x), y = norm(h)·w + b, with fp32 statistics kept for the backward.
// One pass over HBM: the row stays in registers between the reductions and the normalisation. A row per block,
// two vectors per thread (config.cuh with_row_split): few rows in flight per SM and many short blocks, which
// moved the bytes faster than several rows per block or a persistent grid staging rows in shared memory
// (H200, RESULTS.md: 94-98% of copy against 92-97% and 85-90%). The statistics are inline: moving them into a
// helper made ptxas spill at 64 registers.
#pragma once
#include <type_traits>

#include "rows.cuh"

namespace tk_layernorm {
namespace {

// At least 1024 resident threads per SM (registers <= 64; 512 with 4-byte operands): enough rows in flight to
// cover HBM latency. EARLY: the order of torch.compile's kernel at hidden <= 1024: w and b are loaded with x and
// the residual, so the row does not wait on a second round trip after its statistics, and h is stored with y at
// the end; 640 threads per SM (<= 102 registers; 384 with 4-byte operands) hold w and b. (H200, hidden 1024:
// 129.0 us without, 128.5 with, torch.compile 127.6.)
template <class Ty, class S, bool EARLY>
constexpr int fwd_min_blocks() {
  constexpr int threads = Ty::WIDE ? (EARLY ? 384 : 512) : (EARLY ? 640 : 1024);
  return threads / S::BLOCK > 0 ? threads / S::BLOCK : 1;
}

// GATE: h = x·silu(gate) (Ty's X and H are fp32; x and the gate are read in their run-time dtypes).
template <class Ty, class S, bool EARLY, bool GATE = false>
__global__ void __launch_bounds__(S::BLOCK, (fwd_min_blocks<Ty, S, EARLY>())) forward_kernel(ForwardArgs a) {
  using X = typename Ty::X;
  using H = typename Ty::H;
  using W = typename Ty::W;
  using Y = typename Ty::Y;
  tk::grid::wait_prior_grid();  // launched by launch_dependent
  __shared__ float smem[S::BLOCK / 32];
  const int lane = threadIdx.x % S::TPR;
  const int64_t row = int64_t(blockIdx.x) * S::ROWS + threadIdx.x / S::TPR;
  const bool live = row < a.rows;  // no early return: row_sum synchronises the block
  const int nvec = a.hidden / 8;
  const int64_t base = row * a.hidden;
  const X* x = static_cast<const X*>(a.x) + base;
  const H* res = a.residual ? static_cast<const H*>(a.residual) + base : nullptr;
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};

  // Issue every load of the row before any store: stores to h could alias the inputs as far as the
  // compiler knows, so interleaving them would serialise the loads (one vector in flight at a time).
  Pack8<X> xr[S::VECS];
  Pack8<H> rr[S::VECS];
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (live && vi < nvec) {
      if constexpr (GATE) {  // the gate waits in rr (no residual; both fp32 packs)
        float t[8];
        load8_as(t, a.x, a.dtypes.x, base + vi * 8);
        xr[v] = pack<X>(t);
        load8_as(t, a.gate, a.gate_dtype, base + vi * 8);
        rr[v] = pack<H>(t);
      } else {
        xr[v] = load_pack(x + vi * 8);
        if (res) rr[v] = load_pack(res + vi * 8);
      }
    }
  }
  const W* w = static_cast<const W*>(a.weight);
  const W* b = static_cast<const W*>(a.bias);
  Pack8<W> wr[S::VECS], br[S::VECS];
  if constexpr (EARLY) load_wb<W, S>(wr, br, w, b, lane, nvec);
  // The row lives in registers as H (half the registers of fp32 for 16-bit types); h is rounded to H
  // anyway, so unpacking it again below is exact.
  Pack8<H> hp[S::VECS];
  float sum = 0.f;
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    float h[8];
    if (live && vi < nvec) {
      // Statistics of the h that is stored and that eager would normalise: rounded to H.
      if constexpr (GATE) {
        float z[8];
        unpack(h, xr[v]);
        unpack(z, rr[v]);
        gate8(h, z);
        hp[v] = pack<H>(h);
      } else {
        hp[v] = make_h(xr[v], rr[v], res != nullptr, drop, a.dropout.enabled, uint64_t(base) + uint64_t(vi) * 8);
        unpack(h, hp[v]);
      }
      if (!EARLY && (res || a.dropout.enabled)) store_pack(static_cast<H*>(a.h) + base + vi * 8, hp[v]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) h[i] = 0.f;
      hp[v] = pack<H>(h);
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

  Y* y = static_cast<Y*>(a.y) + base;
  if constexpr (!EARLY) load_wb<W, S>(wr, br, w, b, lane, nvec);
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (vi >= nvec) continue;
    if (EARLY && (res || a.dropout.enabled)) store_pack(static_cast<H*>(a.h) + base + vi * 8, hp[v]);
    float out[8];
    norm_vec(out, hp[v], mean, rstd, wr[v], w != nullptr, br[v], b != nullptr);
    store8(y + vi * 8, out);
  }
}

}  // namespace

// The launch for the dtype combinations with this x (forward.cu checks the arguments and picks x); GATED: the gated
// norm's kernels (x fp32: its rows h = x·silu(gate) are recomputed in fp32 from x and the gate in their own dtypes).
template <class X, bool GATED, Rows R>
cudaError_t forward_x(const ForwardArgs& args, cudaStream_t stream) {
  return with_x_types<X>(kernel_types(args.dtypes, GATED), [&](auto ty) {
    using Ty = decltype(ty);
    return with_row_split<R>(args.hidden, [&](auto s) {
      using S = decltype(s);
      // EARLY where the block has at most 64 threads (hidden <= 1024): a 512-thread block holding w and b needs
      // more than 64 registers, so one block per SM (H200, hidden 8192: 1.59 ms against 1.03).
      constexpr bool early = S::BLOCK <= 64;
      const int64_t blocks = (args.rows + S::ROWS - 1) / S::ROWS;
      if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
      if constexpr (GATED) {
        static_assert(std::is_same_v<typename Ty::X, float> && std::is_same_v<typename Ty::H, float>);
        return tk::grid::launch_dependent(forward_kernel<Ty, S, early, true>, unsigned(blocks), S::BLOCK, 0, stream,
                                          args);
      } else {
        return tk::grid::launch_dependent(forward_kernel<Ty, S, early>, unsigned(blocks), S::BLOCK, 0, stream, args);
      }
    });
  });
}

}  // namespace tk_layernorm
