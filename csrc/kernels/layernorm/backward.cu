// Backward: dres = dnorm(h) + dh, dx = dres·mask·scale (mask regenerated from the seed), and dw/db.
// dw/db: each block of a persistent grid accumulates its rows' contributions in fp32 registers and
// writes one partial row; a second kernel sums the partials over blocks in a fixed order (deterministic).
// This file holds the legacy variant, the column sum and the dispatcher; backward_pipe.cu the others.
#include "rows.cuh"

namespace tk_layernorm {
namespace {

template <typename T, class S>
__global__ void __launch_bounds__(S::BLOCK) backward_kernel(BackwardArgs a) {
  tk::grid::wait_prior_grid();  // launched by launch_dependent
  __shared__ float2 red[S::BLOCK / 32];
  __shared__ float acc_smem[S::ROWS > 1 ? S::MAX_HIDDEN : 1];
  const int lane = threadIdx.x % S::TPR;
  const int nvec = a.hidden / 8;
  const float inv_n = 1.f / float(a.hidden);
  const T* w = static_cast<const T*>(a.weight);
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};

  float acc_w[S::VECS][8], acc_b[S::VECS][8];
#pragma unroll
  for (int v = 0; v < S::VECS; ++v)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_w[v][i] = acc_b[v][i] = 0.f;

  // Uniform trip count across the block (row_sum2 synchronises it). Not unrolled: registers hold the accumulators.
#pragma unroll 1
  for (int64_t first = int64_t(blockIdx.x) * S::ROWS; first < a.rows; first += int64_t(gridDim.x) * S::ROWS) {
    const int64_t row = first + threadIdx.x / S::TPR;
    const bool live = row < a.rows;
    const int64_t base = row * a.hidden;
    const float mean = live && a.mean ? a.mean[row] : 0.f;
    const float rstd = live ? a.rstd[row] : 0.f;
    // dy and h stay packed in T between the two passes over the row (half the registers for 16-bit types).
    Pack8<T> dy_raw[S::VECS], h_raw[S::VECS];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      if (live && vi < nvec) {
        dy_raw[v] = load_pack(static_cast<const T*>(a.dy) + base + vi * 8);
        h_raw[v] = load_pack(static_cast<const T*>(a.h) + base + vi * 8);
        float dy[8], xh[8], wv[8];
        unpack(dy, dy_raw[v]);
        unpack(xh, h_raw[v]);
        if (w) load8(wv, w + vi * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float g = w ? dy[i] * wv[i] : dy[i];
          sg += g;
          sgx += g * ((xh[i] - mean) * rstd);
        }
      }
    }
    const float2 sums = row_sum2<S>(sg, sgx, red);
    const float mean_g = a.rms ? 0.f : sums.x * inv_n;
    const float mean_gx = sums.y * inv_n;
    if (!live) continue;
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      if (vi >= nvec) continue;
      float dy[8], xh[8], wv[8], dres[8];
      unpack(dy, dy_raw[v]);
      unpack(xh, h_raw[v]);
      if (w) load8(wv, w + vi * 8);
      if (a.dh) load8(dres, static_cast<const T*>(a.dh) + base + vi * 8);
      backward_vec<T>(a, drop, base, vi, dy, xh, wv, w != nullptr, dres, a.dh != nullptr, mean, rstd, mean_g, mean_gx,
                      acc_w[v], acc_b[v]);
    }
  }
  const int64_t stride = int64_t(gridDim.x) * a.hidden;
  if (a.dw) write_partial<S>(acc_w, a.partial + int64_t(blockIdx.x) * a.hidden, a.hidden, acc_smem);
  if (a.db) write_partial<S>(acc_b, a.partial + stride + int64_t(blockIdx.x) * a.hidden, a.hidden, acc_smem);
}

// out[c] = sum over blocks of partial[blocks][c], in a fixed order: 32 strided slices, then the slices in order.
template <typename T>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* partial, int blocks, int hidden, T* dw, T* db) {
  __shared__ float slices[32][33];
  tk::grid::wait_prior_grid();  // launch_dependent: the main kernel's partials
  T* out = blockIdx.y == 0 ? dw : db;
  if (!out) return;  // uniform per block
  const float* src = partial + int64_t(blockIdx.y) * blocks * hidden;
  const int col = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (col < hidden) {
    // Independent loads in flight: this kernel is pure latency. (Issuing all of a slice's loads, up to 16, before
    // the first add ran 1 us slower per call on the H200 at hidden 1024, 263 partial rows.)
#pragma unroll 8
    for (int k = threadIdx.y; k < blocks; k += 32) s += src[int64_t(k) * hidden + col];
  }
  slices[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    float total = 0.f;
#pragma unroll 8
    for (int j = 0; j < 32; ++j) total += slices[j][threadIdx.x];
    out[col] = from_float<T>(total);
  }
}

template <typename T, class S>
int grid_blocks(int64_t rows) {
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, backward_kernel<T, S>, S::BLOCK, 0);
  const int64_t groups = (rows + S::ROWS - 1) / S::ROWS;
  const int64_t resident = int64_t(sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  return int(groups < 1 ? 1 : (groups < resident ? groups : resident));
}

int legacy_blocks(int64_t rows, int hidden, DType dtype) {
  int blocks = 0;
  const cudaError_t err = with_dtype(dtype, [&](auto t) {
    return with_split<true>(hidden, [&](auto s) {
      blocks = grid_blocks<decltype(t), decltype(s)>(rows);
      return cudaSuccess;
    });
  });
  return err == cudaSuccess ? blocks : 0;
}

}  // namespace

int backward_blocks(const BackwardArgs& args, DType dtype) {
  if (args.variant < 0 || args.variant >= kBackwardVariants) return 0;
  if (args.variant != 0) {
    const int blocks = pipe::backward_blocks(args, dtype);
    if (blocks > 0) return blocks;  // else the pipe variant does not fit: legacy runs
  }
  return legacy_blocks(args.rows, args.hidden, dtype);
}

cudaError_t backward(const BackwardArgs& args, DType dtype, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 8 || args.hidden > kMaxHidden || args.rows < 0) return cudaErrorInvalidValue;
  if (args.variant < 0 || args.variant >= kBackwardVariants) return cudaErrorInvalidValue;
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    // The same choice as backward_blocks, which sized `partial`.
    const int piped = args.variant != 0 ? pipe::backward_blocks(args, dtype) : 0;
    const int blocks = piped > 0 ? piped : legacy_blocks(args.rows, args.hidden, dtype);
    cudaError_t err = piped > 0 ? pipe::backward(args, dtype, blocks, stream)
                                : with_split<true>(args.hidden, [&](auto s) {
                                    using S = decltype(s);
                                    return tk::grid::launch_dependent(backward_kernel<T, S>, blocks, S::BLOCK, 0,
                                                                      stream, args);
                                  });
    if (err != cudaSuccess || (!args.dw && !args.db)) return err;
    return tk::grid::launch_dependent(column_sum_kernel<T>, dim3((args.hidden + 31) / 32, 2), dim3(32, 32), 0, stream,
                                      static_cast<const float*>(args.partial), blocks, args.hidden,
                                      static_cast<T*>(args.dw), static_cast<T*>(args.db));
  });
}

}  // namespace tk_layernorm
