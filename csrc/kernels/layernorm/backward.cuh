// Backward: dres = dnorm(h) + dh, dx = dres·mask·scale (mask regenerated from the seed), and dw/db.
// dw/db: each block of a persistent grid accumulates its rows' contributions in fp32 registers and
// writes one partial row; a second kernel sums the partials over blocks in a fixed order (deterministic).
// This header holds the register-only kernel (fp32 rows, the gated norm, and the shapes whose staging does not fit the
// persistent kernel's shared memory), instantiated per x dtype and row length in backward_<x>_<rows>.cu and for the
// gated norm in backward_gated_<rows>.cu; backward.cu holds the column sum and the dispatcher, backward_pipe*.cu the
// persistent kernel.
#pragma once
#include <type_traits>

#include "rows.cuh"
#include "tk/ops/thread/prefetch.cuh"

namespace tk_layernorm {
namespace {

// dy plus the dy_more present at element `at`, kept packed in Y (the sum rounded to Y once, as eager's add of the
// gradients rounds it; the pipe kernels keep it in fp32).
template <typename Y>
__device__ __forceinline__ Pack8<Y> load_dy(const BackwardArgs& a, int64_t at) {
  const Pack8<Y> dy = load_pack(static_cast<const Y*>(a.dy) + at);
  if (!a.dy_more[0]) return dy;
  float sum[8], more[8];
  unpack(sum, dy);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (a.dy_more[j]) {
      unpack(more, load_pack(static_cast<const Y*>(a.dy_more[j]) + at));
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] += more[i];
    }
  }
  return pack<Y>(sum);
}

// GATE: h = x·silu(gate) recomputed from x and the gate (Ty's X and H are fp32; x, the gate and their gradients
// in their run-time dtypes); writes dx and dgate, not dres.
__device__ __forceinline__ int dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

// Asks L2 for rows [first, first + n) of the operands read per row (one thread): the loop's next rows are in L2
// when it reaches them.
template <class Ty, bool GATE>
__device__ __forceinline__ void prefetch_rows(const BackwardArgs& a, int64_t first, int64_t n) {
  const int64_t at = first * a.hidden;
  const uint32_t count = uint32_t(n * a.hidden);
  const auto ask = [&](const void* p, int size) {
    if (p) tk::prefetch_l2(static_cast<const char*>(p) + at * size, count * uint32_t(size));
  };
  ask(a.dy, sizeof(typename Ty::Y));
  ask(a.dy_more[0], sizeof(typename Ty::Y));
  ask(a.dy_more[1], sizeof(typename Ty::Y));
  ask(a.h, GATE ? dtype_size(a.dtypes.x) : int(sizeof(typename Ty::H)));
  if (GATE) ask(a.gate, dtype_size(a.gate_dtype));
  ask(a.dh, sizeof(typename Ty::H));
}

// Whether the loop prefetches its next rows into L2 (prefetch_rows): where the rows are spread over 512-768 threads,
// and gated rows up to 768 threads (H200: autocast rows 65536 x 4096 1.34 -> 1.09 ms, x 5120 1.62 -> 1.41; the gated
// norm x 2048 0.62 -> 0.52, x 4096 1.13 -> 1.11). Smaller splits of plain rows ran 4-8% slower with it, 1024-thread
// splits about 2% slower.
template <class S, bool GATE>
constexpr bool kPrefetch = S::BLOCK < 1024 && (GATE || S::BLOCK >= 512);

template <class Ty, class S, bool GATE = false>
__global__ void __launch_bounds__(S::BLOCK) backward_kernel(BackwardArgs a) {
  using H = typename Ty::H;
  using W = typename Ty::W;
  using Y = typename Ty::Y;
  tk::grid::wait_prior_grid();  // launched by launch_dependent
  __shared__ float2 red[S::BLOCK / 32];
  __shared__ float acc_smem[S::ROWS > 1 ? S::MAX_HIDDEN : 1];
  const int lane = threadIdx.x % S::TPR;
  const int nvec = a.hidden / 8;
  const float inv_n = 1.f / float(a.hidden);
  const W* w = static_cast<const W*>(a.weight);
  const Dropout drop{a.dropout.seed, a.dropout.offset, a.dropout.threshold, a.dropout.scale};

  float acc_w[S::VECS][8], acc_b[S::VECS][8];
#pragma unroll
  for (int v = 0; v < S::VECS; ++v)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_w[v][i] = acc_b[v][i] = 0.f;

  // Uniform trip count across the block (row_sum2 synchronises it). Not unrolled: registers hold the accumulators.
#pragma unroll 1
  for (int64_t first = int64_t(blockIdx.x) * S::ROWS; first < a.rows; first += int64_t(gridDim.x) * S::ROWS) {
    if (kPrefetch<S, GATE> && threadIdx.x == 0) {
      const int64_t next = first + int64_t(gridDim.x) * S::ROWS;
      if (next < a.rows) prefetch_rows<Ty, GATE>(a, next, a.rows - next < S::ROWS ? a.rows - next : S::ROWS);
    }
    const int64_t row = first + threadIdx.x / S::TPR;
    const bool live = row < a.rows;
    const int64_t base = row * a.hidden;
    const float mean = live && a.mean ? a.mean[row] : 0.f;
    const float rstd = live ? a.rstd[row] : 0.f;
    // dy and h stay packed between the two passes over the row (half the registers for 16-bit types).
    Pack8<Y> dy_raw[S::VECS];
    Pack8<H> h_raw[S::VECS];              // GATE: x
    Pack8<H> z_raw[GATE ? S::VECS : 1];   // GATE: the gate
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int v = 0; v < S::VECS; ++v) {
      const int vi = v * S::TPR + lane;
      if (live && vi < nvec) {
        dy_raw[v] = load_dy<Y>(a, base + vi * 8);
        float dy[8], xh[8], wv[8];
        if constexpr (GATE) {
          float z[8];
          load8_as(xh, a.h, a.dtypes.x, base + vi * 8);
          load8_as(z, a.gate, a.gate_dtype, base + vi * 8);
          h_raw[v] = pack<H>(xh);
          z_raw[v] = pack<H>(z);
          gate8(xh, z);
        } else {
          h_raw[v] = load_pack(static_cast<const H*>(a.h) + base + vi * 8);
          unpack(xh, h_raw[v]);
        }
        unpack(dy, dy_raw[v]);
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
      if (w) load8(wv, w + vi * 8);
      if constexpr (GATE) {
        float x[8], z[8], sg[8];
        unpack(x, h_raw[v]);
        unpack(z, z_raw[v]);
#pragma unroll
        for (int i = 0; i < 8; ++i) xh[i] = x[i];
        gate8(xh, z, sg);
#pragma unroll
        for (int i = 0; i < 8; ++i) xh[i] = (xh[i] - mean) * rstd;
        dnorm_vec(dy, xh, wv, w != nullptr, dres, false, rstd, mean_g, mean_gx, acc_w[v], acc_b[v]);
        store_gate_grads(a, base + vi * 8, dres, x, z, sg);
        continue;
      }
      unpack(xh, h_raw[v]);
      if (a.dh) load8(dres, static_cast<const H*>(a.dh) + base + vi * 8);
      backward_vec<Ty>(a, drop, base, vi, dy, xh, wv, w != nullptr, dres, a.dh != nullptr, mean, rstd, mean_g, mean_gx,
                      acc_w[v], acc_b[v]);
    }
  }
  const int64_t stride = int64_t(gridDim.x) * a.hidden;
  if (a.dw) write_partial<S>(acc_w, a.partial + int64_t(blockIdx.x) * a.hidden, a.hidden, acc_smem);
  if (a.db) write_partial<S>(acc_b, a.partial + stride + int64_t(blockIdx.x) * a.hidden, a.hidden, acc_smem);
}

template <class Ty, class S, bool GATE>
int grid_blocks(int64_t rows) {
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, backward_kernel<Ty, S, GATE>, S::BLOCK, 0);
  const int64_t groups = (rows + S::ROWS - 1) / S::ROWS;
  const int64_t resident = int64_t(sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  return int(groups < 1 ? 1 : (groups < resident ? groups : resident));
}

// Calls f(Ty, S, GATE) for the register-only kernel of these args with x of dtype X, gated or not (gated kernels exist
// for the fp32 types only).
template <class X, bool GATED, Rows R, typename F>
cudaError_t with_registers_kernel(const BackwardArgs& args, F&& f) {
  return with_x_types<X>(kernel_types(args.dtypes, args.gate), [&](auto ty) {
    using Ty = decltype(ty);
    if constexpr (GATED) {
      if constexpr (std::is_same_v<typename Ty::X, float> && std::is_same_v<typename Ty::H, float>)
        return with_split<R, true>(args.hidden, [&](auto s) { return f(ty, s, std::true_type{}); });
      else return cudaErrorInvalidValue;
    } else {
      return with_split<R>(args.hidden, [&](auto s) { return f(ty, s, std::false_type{}); });
    }
  });
}

}  // namespace

template <class X, bool GATED, Rows R>
int registers_blocks_x(const BackwardArgs& args) {
  int blocks = 0;
  const cudaError_t err = with_registers_kernel<X, GATED, R>(args, [&](auto ty, auto s, auto gate) {
    blocks = grid_blocks<decltype(ty), decltype(s), decltype(gate)::value>(args.rows);
    return cudaSuccess;
  });
  return err == cudaSuccess ? blocks : 0;
}

template <class X, bool GATED, Rows R>
cudaError_t registers_backward_x(const BackwardArgs& args, int blocks, cudaStream_t stream) {
  return with_registers_kernel<X, GATED, R>(args, [&](auto ty, auto s, auto gate) {
    using S = decltype(s);
    return tk::grid::launch_dependent(backward_kernel<decltype(ty), S, decltype(gate)::value>, blocks, S::BLOCK, 0,
                                      stream, args);
  });
}

}  // namespace tk_layernorm
