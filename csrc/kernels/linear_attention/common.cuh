// What the Based and plain kernels share: the launches' q/k/v tensor maps, the one-warpgroup launch, and the
// normalised backward's first launch, delta = do·o per row.
#pragma once
#include <tk/tk.cuh>

#include "linear_attention.h"

namespace tk_linear_attention {
namespace {

using namespace tk;

// The q, k and v tensor maps of a launch (G's q, k and v; A: the Based or plain arguments, the views with their
// element strides): q and k of `Cols` feature columns, v at the blocks' 64-column tiles.
template <int Cols, class G, class A> const char* make_input_maps(G& g, const A& a) {
  const auto view = [&](const void* p, int cols, const int64_t (&st)[3]) {
    return gl<bf16>(static_cast<bf16*>(const_cast<void*>(p)), a.B, a.H, a.N, cols, st[0], st[1], st[2]);
  };
  if (const char* e = make_tma_map(g.q, view(a.q, Cols, a.q_stride))) return e;
  if (const char* e = make_tma_map(g.k, view(a.k, Cols, a.k_stride))) return e;
  return make_tma_map(g.v, view(a.v, a.dv, a.v_stride));
}

// Launches `kernel` on `blocks` one-warpgroup blocks with `smem` bytes of dynamic shared memory (set on every call:
// the attribute belongs to the current device's context).
template <class G>
const char* launch_warpgroups(void (*kernel)(G), int64_t blocks, size_t smem, const G& g, cudaStream_t stream) {
  if (blocks > 0x7fffffff) return "too many (batch, head, value tile) blocks for one launch";
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (attr != cudaSuccess) return cudaGetErrorString(attr);
  kernel<<<unsigned(blocks), WARPGROUP_THREADS, smem, stream>>>(g);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// delta = do·o per row of (B·H·N, dv) contiguous bf16 rows: one warp a row (one kernel instead of ATen's four passes
// through fp32 copies).
__global__ void __launch_bounds__(256) bwd_delta_kernel(const BasedBwdArgs a, int64_t rows) {
  const int64_t row = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;
  const bf16_2* dout = static_cast<const bf16_2*>(a.dout) + row * (a.dv / 2);
  const bf16_2* o = static_cast<const bf16_2*>(a.o) + row * (a.dv / 2);
  float sum = 0.f;
  for (int i = laneid(); i < a.dv / 2; i += 32) {
    const float2 d = __bfloat1622float2(dout[i]), y = __bfloat1622float2(o[i]);
    sum += d.x * y.x + d.y * y.y;
  }
  sum = warp_sum(sum);
  if (laneid() == 0) a.delta[row] = sum;
}

// delta for a.B·a.H·a.N rows of a.dv columns (a.dout, a.o contiguous bf16) into a.delta.
inline const char* launch_delta(const BasedBwdArgs& a, cudaStream_t stream) {
  const int64_t rows = int64_t(a.B) * a.H * a.N, blocks = (rows + 7) / 8;
  if (blocks > 0x7fffffff) return "too many rows for the delta launch";
  bwd_delta_kernel<<<unsigned(blocks), 256, 0, stream>>>(a, rows);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace
}  // namespace tk_linear_attention
