// Forward: h = residual + dropout(x), y = norm(h)·w + b, with fp32 statistics kept for the backward.
// One pass over HBM: the row stays in registers between the reductions and the normalisation.
#include "config.cuh"
#include "philox.cuh"

namespace tk_layernorm {
namespace {

template <typename T, class S>
__global__ void __launch_bounds__(S::BLOCK) forward_kernel(ForwardArgs a) {
  __shared__ float smem[S::BLOCK / 32];
  const int lane = threadIdx.x % S::TPR;
  const int64_t row = int64_t(blockIdx.x) * S::ROWS + threadIdx.x / S::TPR;
  const bool live = row < a.rows;  // no early return: row_sum synchronises the block
  const int nvec = a.hidden / 8;
  const int64_t base = row * a.hidden;
  const T* x = static_cast<const T*>(a.x) + base;
  const T* res = a.residual ? static_cast<const T*>(a.residual) + base : nullptr;
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};

  float h[S::VECS][8];
  float sum = 0.f;
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (live && vi < nvec) {
      load8(h[v], x + vi * 8);
      if (a.dropout.enabled) {
        const uint32_t keep = drop.keep8(uint64_t(base) + uint64_t(vi) * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) h[v][i] = (keep >> i & 1u) ? __fmul_rn(h[v][i], drop.scale) : 0.f;
      }
      if (res) {
        float r[8];
        load8(r, res + vi * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) h[v][i] = __fadd_rn(r[i], h[v][i]);
      }
      if (res || a.dropout.enabled) {
        // Statistics of the h that is stored and that eager would normalise: rounded to T.
#pragma unroll
        for (int i = 0; i < 8; ++i) h[v][i] = round_to<T>(h[v][i]);
        store8(static_cast<T*>(a.h) + base + vi * 8, h[v]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) h[v][i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += h[v][i];
  }

  const float inv_n = 1.f / float(a.hidden);
  float mean = 0.f, sq = 0.f;
  if (!a.rms) {
    mean = row_sum<S>(sum, smem) * inv_n;
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      if (v * S::TPR + lane < nvec) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += (h[v][i] - mean) * (h[v][i] - mean);
      }
    }
  } else {
#pragma unroll
    for (int v = 0; v < S::VECS; ++v)
#pragma unroll
      for (int i = 0; i < 8; ++i) sq += h[v][i] * h[v][i];
  }
  const float rstd = rsqrtf(row_sum<S>(sq, smem) * inv_n + a.eps);
  if (!live) return;  // no block-wide sync below
  if (lane == 0) {
    a.rstd[row] = rstd;
    if (a.mean) a.mean[row] = mean;
  }

  const T* w = static_cast<const T*>(a.weight);
  const T* b = static_cast<const T*>(a.bias);
  T* y = static_cast<T*>(a.y) + base;
#pragma unroll
  for (int v = 0; v < S::VECS; ++v) {
    const int vi = v * S::TPR + lane;
    if (vi >= nvec) continue;
    float out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = (h[v][i] - mean) * rstd;
    if (w) {
      float wv[8];
      load8(wv, w + vi * 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] *= wv[i];
    }
    if (b) {
      float bv[8];
      load8(bv, b + vi * 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] += bv[i];
    }
    store8(y + vi * 8, out);
  }
}

}  // namespace

cudaError_t forward(const ForwardArgs& args, DType dtype, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 8 || args.hidden > kMaxHidden || args.rows < 0) return cudaErrorInvalidValue;
  if (args.rows == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return with_split<false>(args.hidden, [&](auto s) {
      using S = decltype(s);
      const int64_t blocks = (args.rows + S::ROWS - 1) / S::ROWS;
      if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
      forward_kernel<T, S><<<unsigned(blocks), S::BLOCK, 0, stream>>>(args);
      return cudaGetLastError();
    });
  });
}

}  // namespace tk_layernorm
