// The Based kernels' shared pieces: the chunk and feature constants (forward: based.cu, backward: based_backward.cu),
// and the backward's tile types, input rows and the state update both of its scans run (mma.sync, 8 warps).
// There φ has 288 features in 18 tiles of 16: tile a < 16 holds k_a·k_b (b = 0..15), tile 16 holds k_b, tile 17 the
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

// A state update: for this warp's feature tiles f (w, w + 8, w + 16), state_f += φ(x)ᵀ values and, with
// `with_vec`, vec_f += Σ_t weight(t) φ(x_t); then the bf16 copy of the state is published. φ is the feature map of
// the tokens' 16-wide rows x with its quadratic and linear factors (φk: 1, 1; φq: scale²/2, scale). The
// backward's dq scan adds φk(k)ᵀ v and z = Σ φk (the forward's state); its reverse scan adds φq(q)ᵀ dn and r = Σ dd φq.
template <int DVT, class S, class Weight>
__device__ __forceinline__ void state_update(S& s, const QKTile& x, const st<bf16, CHUNK, DVT>& values, float quad,
                                             float lin, bool with_vec, Weight&& weight,
                                             rt_fl<BASE, DVT> (&acc)[OWNED]) {
  const int warp = warpid(), lane = laneid();
  rt_bf<CHUNK, DVT, col_layout> vall;
  load(vall, values);
  // x (64 x 16) loaded in col layout: the registers of xᵀ (features x tokens) in row layout
  rt_bf<CHUNK, DK, col_layout> xc;
  load(xc, x);
#pragma unroll
  for (int i = 0; i < OWNED; ++i) {
    const int f = warp + WARPS * i;
    if (f >= TILES) break;
    rt_bf<BASE, CHUNK> phi;  // φ(x)ᵀ rows of tile f: (feature b, token t)
    float vs[2] = {0.f, 0.f};
    map_indexed(phi, transposed(xc), [&](int b, int t, float xb) {
      const float val = f < DK ? quad * __bfloat162float(x(t, f)) * xb : f == DK ? lin * xb : (b == 0 ? 1.f : 0.f);
      vs[b >> 3] += weight(t) * val;
      return val;
    });
    mma_AB(acc[i], phi, vall, acc[i]);
    if (with_vec)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float sum = quad_sum(vs[r]);
        if ((lane & 3) == 0) s.z[BASE * f + (lane >> 2) + 8 * r] += sum;
      }
    rt_bf<BASE, DVT> copy_bf;
    copy(copy_bf, acc[i]);
    store(s.state, copy_bf, BASE * f, 0);
  }
}

// The dq scan's state update (the forward's state): state += φk(k)ᵀ v and z += Σ φk(k).
template <int DVT, class S>
__device__ __forceinline__ void chunk_state(S& s, int buf, rt_fl<BASE, DVT> (&acc)[OWNED]) {
  state_update<DVT>(s, s.k[buf], s.v[buf], 1.f, 1.f, true, [](int) { return 1.f; }, acc);
}

// Rows row0 + r of a (·, ld) bf16 matrix from a 16-row register tile (this lane's rows r0 and r0 + 8 of the tile,
// scaled by row_scale[0] and [1]), columns col0..; rows at or past N are skipped.
template <int W>
__device__ __forceinline__ void store_rows(bf16* dst, int64_t ld, const rt_fl<BASE, W>& t, int row0, int N, int col0,
                                           const float (&row_scale)[2]) {
#pragma unroll
  for (int j = 0; j < W / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int n = row0 + base_row<row_layout>(k, 0);
      if (n >= N) continue;
      const float2 v = t.tiles[0][j].data[k];
      bf16_2 pair;
      pair.x = __float2bfloat16_rn(v.x * row_scale[k & 1]);
      pair.y = __float2bfloat16_rn(v.y * row_scale[k & 1]);
      *reinterpret_cast<bf16_2*>(dst + int64_t(n) * ld + col0 + BASE * j + base_col<row_layout>(k, 0)) = pair;
    }
}

}  // namespace
}  // namespace tk_linear_attention
