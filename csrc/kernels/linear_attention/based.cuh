// The Based kernels' shared pieces (forward: based.cu, backward: based_backward.cu): chunk and feature-map constants,
// tile types, the block's input rows, and the state update that the forward and the backward's dq scan both run.
// φ has 288 features in 18 tiles of 16: tile a < 16 holds k_a·k_b (b = 0..15), tile 16 holds k_b, tile 17 the
// constant 1 (row 0; rows 1-15 are zero); φq is the same with scale²/2, scale and 1 folded in, so
// φq(q)·φk(k) = 1 + s + s²/2. Nothing of size 288 is ever in global memory: both maps are built in registers
// from the 16-wide q and k rows.
#pragma once
#include <tk/tk.cuh>
#include <tk/ops/thread/cp_async.cuh>
#include <tk/ops/warp/mma.cuh>

#include "linear_attention.h"

namespace tk_linear_attention {
namespace {

using namespace tk;

constexpr int CHUNK = 64, DK = BASED_DK, WARPS = 8, THREADS = WARPS * 32;
constexpr int TILES = 18, FEATURES = TILES * BASE;   // 256 quadratic + 16 linear + 1 constant (+ 15 zero rows)
constexpr int OWNED = (TILES + WARPS - 1) / WARPS;  // state tiles per warp: 3 for warps 0-1, 2 for the others
static_assert(DK == BASE, "the feature maps are built per 16x16 base tile");

using QKTile = st<bf16, CHUNK, DK>;
template <int DVT> using VTile = st<bf16, CHUNK, DVT>;
template <int DVT> using StateTile = st<bf16, FEATURES, DVT>;

struct Rows {  // this block's (batch, head) rows; v and o already offset to the block's column tile
  const bf16* q;
  const bf16* k;
  const bf16* v;
  int64_t qn, kn, vn;  // row strides
  int N;
};

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Phase 2: add the chunk's keys to this warp's state tiles and publish them (and z) for the next chunk.
template <int DVT, class S>
__device__ __forceinline__ void chunk_state(S& s, int buf, rt_fl<BASE, DVT> (&acc)[OWNED]) {
  const int warp = warpid(), lane = laneid();
  rt_bf<CHUNK, DVT, col_layout> vall;
  load(vall, s.v[buf]);
  // K (64 x 16) loaded in col layout: the registers of Kᵀ (features x tokens) in row layout
  rt_bf<CHUNK, DK, col_layout> kc;
  load(kc, s.k[buf]);
#pragma unroll
  for (int i = 0; i < OWNED; ++i) {
    const int f = warp + WARPS * i;
    if (f >= TILES) break;
    rt_bf<BASE, CHUNK> phi;  // φk(k)ᵀ rows of tile f: (feature b, token t)
    float zs[2] = {0.f, 0.f};
    map_indexed(phi, transposed(kc), [&](int b, int t, float kb) {
      const float val = f < DK ? __bfloat162float(s.k[buf](t, f)) * kb : f == DK ? kb : (b == 0 ? 1.f : 0.f);
      zs[b >> 3] += val;
      return val;
    });
    mma_AB(acc[i], phi, vall, acc[i]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(zs[r]);
      if ((lane & 3) == 0) s.z[BASE * f + (lane >> 2) + 8 * r] += sum;
    }
    rt_bf<BASE, DVT> copy_bf;
    copy(copy_bf, acc[i]);
    store(s.state, copy_bf, BASE * f, 0);
  }
}

}  // namespace
}  // namespace tk_linear_attention
