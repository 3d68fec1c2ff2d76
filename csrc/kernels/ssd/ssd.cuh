// What the SSD forward (ssd.cu) and backward (ssd_backward.cu) share: the chunk constants, the block's rows and
// their chunk loads, and a token's value from the lanes' pairs.
#pragma once
#include <tk/tk.cuh>
#include <tk/ops/thread/cp_async.cuh>
#include <tk/ops/warp/mma.cuh>

#include "ssd.h"

namespace tk_ssd {
namespace {

using namespace tk;

constexpr int CHUNK = 64, WARPS = 8, THREADS = WARPS * 32;

template <int NS>
struct Rows {  // this block's rows in global memory, and their strides (elements)
  const bf16* x;
  const bf16* b;
  const bf16* c;
  const float* dt;
  int64_t x_row, bc_row, dt_row;
  int l;
};

// x, B, C and dt of chunk c into buffer `buf` of a shared struct with those members, as one cp.async group; rows
// past l are zero-filled (dt = 0: no decay, no input).
template <int NS, class S>
__device__ __forceinline__ void load_chunk(S& s, int buf, const Rows<NS>& g, int c) {
  using XT = std::remove_reference_t<decltype(s.x[0])>;
  using BT = st<bf16, CHUNK, NS>;
  constexpr int PT = XT::cols;
  const int tid = threadIdx.x, n0 = c * CHUNK;
#pragma unroll
  for (int i = 0; i < CHUNK * PT / 8 / THREADS; ++i) {  // x: PT / 8 segments of 8 per row
    const int t = tid + i * THREADS, r = t / (PT / 8), seg = t % (PT / 8), n = n0 + r;
    const bool ok = n < g.l;
    cp_async16(smem_addr(s.x[buf].data) + XT::offset(r, seg * 8), g.x + (ok ? n * g.x_row + seg * 8 : 0), ok);
  }
#pragma unroll
  for (int i = 0; i < CHUNK * NS / 8 / THREADS; ++i) {  // B and C: n/8 segments per row
    const int t = tid + i * THREADS, r = t / (NS / 8), seg = t % (NS / 8), n = n0 + r;
    const bool ok = n < g.l;
    const int64_t off = ok ? n * g.bc_row + seg * 8 : 0;
    cp_async16(smem_addr(s.b[buf].data) + BT::offset(r, seg * 8), g.b + off, ok);
    cp_async16(smem_addr(s.c[buf].data) + BT::offset(r, seg * 8), g.c + off, ok);
  }
  if (tid < CHUNK) {
    const bool ok = n0 + tid < g.l;
    cp_async4(smem_addr(&s.dt[buf][tid]), g.dt + (ok ? (n0 + tid) * g.dt_row : 0), ok);
  }
  cp_async_commit();
}

// The value of token t (0..63) from the lanes' pairs (lane holds tokens 2·lane and 2·lane + 1). All lanes must call
// it (shuffles).
__device__ __forceinline__ float pair_at(float v0, float v1, int t) {
  const float a0 = __shfl_sync(0xffffffffu, v0, t >> 1), a1 = __shfl_sync(0xffffffffu, v1, t >> 1);
  return (t & 1) ? a1 : a0;
}

}  // namespace
}  // namespace tk_ssd
