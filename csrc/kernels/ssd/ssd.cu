// Mamba-2 SSD forward (ssd.h): a chunked scan with the fp32 state in registers.
//
// One block per (batch, head, 64 head dims of p) walks the sequence in chunks of 64 tokens. With a_t = dt_t·A and
// Λ the inclusive cumulative sum of a inside the chunk, and S = hᵀ (n x p) the state before the chunk:
//   y_t  = Σ_{s≤t} (C_t·B_s) exp(Λ_t − Λ_s) dt_s x_s       (intra-chunk: masked "attention" with a decay)
//        + exp(Λ_t) C_t S                                    (inter-chunk: everything before the chunk)
//        + D x_t
//   S   ← exp(Λ_end) S + Σ_s exp(Λ_end − Λ_s) dt_s B_sᵀ x_s  (then the next chunk)
// All four products run on mma.sync (tk/ops/warp/mma.cuh); the decays are applied to the bf16 operands as they
// are built. Warps: 8. For the outputs, warp w owns chunk rows 16·(w/2).. and head dims 32·(w%2)..; for the
// state, warp w < n/16 owns rows 16w.. of S as an fp32 register tile (16 x 64) and publishes a bf16 copy in shared
// memory for the next chunk's inter-chunk product. Every warp computes Λ itself (a shuffle scan over the 64
// tokens, two per lane), so a chunk needs only the two block barriers around the state update. Loads are
// cp.async, double-buffered; padded tokens past l load as zeros (dt = 0: no decay, no input), so the final state
// is the state after token l.
#include "ssd.cuh"

namespace tk_ssd {
namespace {

// PT: head dims per block (64, or 32 for twice the blocks when batch·heads leave SMs idle).
template <int NS, int PT>
struct Smem {
  st<bf16, CHUNK, PT> x[2];
  st<bf16, CHUNK, NS> b[2], c[2];
  st<bf16, NS, PT> state;  // bf16 copy of S (n x p) before the current chunk
  float dt[2][CHUNK];
};

// MIN_BLOCKS: blocks per SM the register budget is set for (2 for grids past one wave: more warps to hide mma.sync
// latency).
template <int NS, int PT, int MIN_BLOCKS>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) ssd_fwd_kernel(const Args a) {
  extern __shared__ uint8_t raw[];
  Smem<NS, PT>& s = *reinterpret_cast<Smem<NS, PT>*>(align_shared<1024>(raw));
  constexpr int HALF = PT / 2;  // head dims per output warp
  const int ptiles = a.p / PT;
  const int pt = blockIdx.x % ptiles, bh = blockIdx.x / ptiles;
  const int bi = bh / a.nh, h = bh % a.nh, grp_of_head = h / (a.nh / a.ng);
  Rows<NS> g;
  g.x = static_cast<const bf16*>(a.x) + (int64_t(bi) * a.l * a.nh + h) * a.p + pt * PT;
  g.b = static_cast<const bf16*>(a.B) + (int64_t(bi) * a.l * a.ng + grp_of_head) * NS;
  g.c = static_cast<const bf16*>(a.C) + (int64_t(bi) * a.l * a.ng + grp_of_head) * NS;
  g.dt = a.dt + int64_t(bi) * a.l * a.nh + h;
  g.x_row = int64_t(a.nh) * a.p, g.bc_row = int64_t(a.ng) * NS, g.dt_row = a.nh;
  g.l = a.l;
  float* y = a.y + (int64_t(bi) * a.l * a.nh + h) * a.p + pt * PT;
  const int64_t y_row = int64_t(a.nh) * a.p;
  const int64_t state_base = (int64_t(bh) * a.p + pt * PT) * NS;  // (b, h, p0, 0) of (b, nh, p, n)
  const float Ah = a.A[h], Dh = a.D ? a.D[h] : 0.f;

  const int warp = warpid(), lane = laneid(), grp = warp >> 1, cols = HALF * (warp & 1);
  const bool owner = warp < NS / BASE;
  load_chunk(s, 0, g, 0);

  // the state rows this warp owns (S = hᵀ: rows are state dims, columns head dims), from h0 or zero (read_state's
  // loop, kept inline for the same reason as the scan below)
  rt_fl<BASE, PT> S;
#pragma unroll
  for (int j = 0; j < PT / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float2 v = make_float2(0.f, 0.f);
      if (owner && a.h0) {
        const int r = BASE * warp + base_row<row_layout>(k, 0), cc = BASE * j + base_col<row_layout>(k, 0);
        v.x = a.h0[state_base + int64_t(cc) * NS + r];
        v.y = a.h0[state_base + int64_t(cc + 1) * NS + r];
      }
      S.tiles[0][j].data[k] = v;
    }
  if (owner) publish_state(s, S, warp);

  const int chunks = (a.l + CHUNK - 1) / CHUNK;
  for (int c = 0; c < chunks; ++c) {
    const int buf = c & 1;
    cp_async_wait<0>();
    __syncthreads();  // chunk c and the state before it are visible; chunk c - 1's buffers are free
    if (c + 1 < chunks) load_chunk(s, buf ^ 1, g, c + 1);

    // Λ: inclusive cumulative sum of dt·A over the chunk, two tokens per lane (chunk_decays' scan, kept inline: as a
    // call the compiler schedules the whole kernel differently)
    const float dt0 = s.dt[buf][2 * lane], dt1 = s.dt[buf][2 * lane + 1];
    const float a0 = dt0 * Ah, a1 = dt1 * Ah;
    float run = a0 + a1;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const float up = __shfl_up_sync(0xffffffffu, run, off);
      if (lane >= off) run += up;
    }
    const float l1 = run, l0 = run - a1, l_end = __shfl_sync(0xffffffffu, l1, 31);
    const Decays d{dt0, dt1, l0, l1, l_end};

    // ---- outputs: this warp's 16 rows x 32 head dims
    {
      const int t0 = BASE * grp + (lane >> 2);  // this lane's rows: t0 and t0 + 8
      const float lt[2] = {d.lam(t0), d.lam(t0 + 8)};
      rt_fl<BASE, CHUNK> cb;  // C_t · B_s
      zero(cb);
#pragma unroll
      for (int kk = 0; kk < NS / BASE; ++kk) {
        rt_bf<BASE, BASE> cw;
        load(cw, s.c[buf], BASE * grp, BASE * kk);
        rt_bf<CHUNK, BASE> bk;
        load(bk, s.b[buf], 0, BASE * kk);
        mma_ABt(cb, cw, bk, cb);
      }
      rt_bf<BASE, CHUNK> w;  // (C_t·B_s) exp(Λ_t − Λ_s) dt_s on and below the diagonal
      causal_decay<false>(w, cb, d, lt, BASE * grp, [&](int, int src) { return d.dt_col(src); });
      rt_bf<CHUNK, HALF, col_layout> xr;
      load(xr, s.x[buf], 0, cols);
      rt_fl<BASE, HALF> out;
      zero(out);
      mma_AB(out, w, xr, out);
      // inter-chunk: exp(Λ_t) C_t · S, the decay folded into C's rows. C's tiles are loaded again rather than
      // kept from the loop above: fusing the two loops keeps cb and out live together (178 -> 214 registers,
      // and the two-blocks-per-SM kernel spills 96 bytes instead of 24) to save 8 ldmatrix per warp and chunk.
      const float decay[2] = {__expf(lt[0]), __expf(lt[1])};
#pragma unroll
      for (int kk = 0; kk < NS / BASE; ++kk) {
        rt_bf<BASE, BASE> cw;
        load(cw, s.c[buf], BASE * grp, BASE * kk);
        map_indexed(cw, cw, [&](int r, int, float v) { return v * decay[r >> 3]; });
        rt_bf<BASE, HALF, col_layout> sv;
        load(sv, s.state, BASE * kk, cols);
        mma_AB(out, cw, sv, out);
      }
#pragma unroll
      for (int j = 0; j < HALF / BASE; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int t = t0 + 8 * (k & 1), n = c * CHUNK + t;
          if (n >= a.l) continue;
          const int col = cols + BASE * j + base_col<row_layout>(k, 0);
          float2 v = out.tiles[0][j].data[k];
          if (a.D) {
            v.x += Dh * __bfloat162float(s.x[buf](t, col));
            v.y += Dh * __bfloat162float(s.x[buf](t, col + 1));
          }
          *reinterpret_cast<float2*>(y + n * y_row + col) = v;
        }
    }
    __syncthreads();  // every warp has read the state before its owners change it

    // ---- state: S ← exp(Λ_end) S + Σ_s exp(Λ_end − Λ_s) dt_s B_sᵀ x_s
    if (owner) {
      const float keep = __expf(d.l_end);
#pragma unroll
      for (int j = 0; j < PT / BASE; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) S.tiles[0][j].data[k].x *= keep, S.tiles[0][j].data[k].y *= keep;
#pragma unroll
      for (int j = 0; j < CHUNK / BASE; ++j) {
        // B's tokens 16j.. by this warp's 16 state dims, loaded in col layout: Bᵀ (state dims x tokens)
        rt_bf<BASE, BASE, col_layout> bt;
        load(bt, s.b[buf], BASE * j, BASE * warp);
        rt_bf<BASE, BASE> wb;  // Bᵀ with each token's column scaled by exp(Λ_end − Λ_s) dt_s
        map_indexed(wb, transposed(bt), [&](int, int col, float v) {
          const int src = BASE * j + col;
          const float ls = d.lam_col(src), ds = d.dt_col(src);
          return v * __expf(d.l_end - ls) * ds;
        });
        rt_bf<BASE, PT, col_layout> xj;
        load(xj, s.x[buf], BASE * j, 0);
        mma_AB(S, wb, xj, S);
      }
      publish_state(s, S, warp);
    }
  }

  if (owner) write_state<NS>(a.h_final, S, state_base, warp);  // the final state, transposed back to (p, n)
}

template <int NS, int PT, int MIN_BLOCKS>
const char* launch_n(const Args& a, cudaStream_t stream) {
  const int64_t blocks = int64_t(a.b) * a.nh * (a.p / PT);
  if (blocks > 0x7fffffff) return "too many (batch, head, head-dim tile) blocks for one launch";
  const size_t smem = sizeof(Smem<NS, PT>) + 1024;  // + the alignment of the dynamic shared memory base
  const auto kernel = ssd_fwd_kernel<NS, PT, MIN_BLOCKS>;
  // per call: the attribute belongs to the current device's context
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (attr != cudaSuccess) return cudaGetErrorString(attr);
  kernel<<<unsigned(blocks), THREADS, smem, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Measured on the H200 (benchmarks/RESULTS.md): two blocks per SM (1) is 9-16% faster than one (0) once
// the grid of 64-head-dim blocks spans more than one wave; a grid that fills at most half the SMs runs faster as
// twice the blocks of 32 head dims (2: b1 nh32 p64 0.30 ms vs 0.36), and in between one wave of (0) is best.
int choose_kernel(const Args& a) {
  const long long blocks = (long long)a.b * a.nh * (a.p / P_TILE);
  if (2 * blocks <= tk::grid::sm_count()) return 2;
  return tk::grid::waves_of(blocks, 1) == 1 ? 0 : 1;
}

}  // namespace

const char* launch(const Args& a, cudaStream_t stream) {
  if (a.p <= 0 || a.p % P_TILE != 0) return "the head dim p must be a positive multiple of 64";
  if (a.ng <= 0 || a.nh % a.ng != 0) return "nh must be a multiple of ng";
  if (a.b <= 0 || a.nh <= 0) return nullptr;  // nothing to compute
  if (a.l <= 0) return "l must be >= 1 (the binding handles empty sequences)";
  switch (a.n * 4 + choose_kernel(a)) {
    case 64 * 4 + 0: return launch_n<64, 64, 1>(a, stream);
    case 64 * 4 + 1: return launch_n<64, 64, 2>(a, stream);
    case 64 * 4 + 2: return launch_n<64, 32, 1>(a, stream);
    case 128 * 4 + 0: return launch_n<128, 64, 1>(a, stream);
    case 128 * 4 + 1: return launch_n<128, 64, 2>(a, stream);
    case 128 * 4 + 2: return launch_n<128, 32, 1>(a, stream);
    default: return "the state size n must be 64 or 128";
  }
}

}  // namespace tk_ssd
