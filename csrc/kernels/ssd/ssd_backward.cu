// Mamba-2 SSD backward (ssd.h): the gradients of X = dt·x, B, C and the initial state as two chunked scans of the
// forward's shape (ssd.cuh: tasks, inputs, the state in a warpgroup's accumulator; README "Backward" has the plan).
// Per head, with Λ the inclusive cumulative sum of a = dt·A inside the chunk and h, g (64 head dims × n) the state
// and ∂L/∂h:
//   kernel A, chunks first to last over h (from h0):
//     dC_t = exp(Λ_t) dy_t h + Σ_{s≤t} exp(Λ_t − Λ_s) dt_s (dy_t·x_s) B_s;  h ← exp(Λ_end) h + Xᵀ diag(…) B
//   kernel B, chunks last to first over g (from the final state's gradient):
//     dX_s = exp(Λ_end − Λ_s) B_s gᵀ + Σ_{t≥s} exp(Λ_t − Λ_s) (B_s·C_t) dy_t
//     dB_s = exp(Λ_end − Λ_s) dt_s x_s g + Σ_{t≥s} exp(Λ_t − Λ_s) dt_s (x_s·dy_t) C_t
//     g ← exp(Λ_end) g + dyᵀ diag(exp(Λ_t)) C;  dh0 = g after chunk 0
// Every product is a wgmma: the chunk products from shared memory, the masked ones and the state updates with
// register A operands. The kernels also reduce what the binding needs, so that no per-head (b, l, nh, n) or fp32
// (b, l, nh, p) tensor is written: dB and dC go straight to their group's rows, and per token dlam = C·dC_h − B·dB_h
// and Σ_p x·dX, by fp32 atomics over heads and head-dim tiles (the binding zeroes them); kernel B writes
// dx = dt·dX + D·dy in bf16 and sums dD = Σ x·dy. The binding then forms dt's and A's gradients: da is dlam summed
// from the back inside each chunk, plus the chunk's anchor ⟨g, h⟩ at its end (all later tokens' share, exactly):
// kernel A writes each chunk-end state in bf16, in its registers' order, and kernel B dots it with its g.
#include "ssd.cuh"

namespace tk_ssd {
namespace {

template <int NS>
struct BwdGlobals {
  Stream<NS> in;
  const float* A;
  const float* D;   // or nullptr
  const float* h0;  // or nullptr
  const float* dh;  // or nullptr
  bf16* dx;
  float *dB, *dC, *dlam, *xdX, *dD, *dh0, *anchor;
  uint4* chunk_states;
  Segments fwd, rev;  // a split sequence's segment states (Shape::segments > 1): h's for kernel A, g's for kernel B
};

// The bf16 chunk-end state of task t's head h at chunk c, in the order of a warpgroup's accumulator registers: slot j
// of thread i at (j·128 + i) 16-byte words from the start of the (head, head-dim tile, chunk) block.
template <int NS>
__device__ __forceinline__ uint4* chunk_state(const BwdGlobals<NS>& g, const lcsf::task& t, const Slot& sl, int c) {
  const Shape& s = g.in.shape;
  const int64_t block = ((int64_t(t.coord[0]) * s.nh) * s.ptiles + sl.tile) * s.chunks + c;
  return g.chunk_states + block * (PT * NS / 8) + threadIdx.x % WARPGROUP_THREADS;
}

// Adds a warp's 16 rows (tokens chunk·64 + 16·warp + r) of an fp32 tile to a (b, l, ·) tensor's rows at `base`
// (its element (b, 0, col0)); rows past l skipped.
template <int W>
__device__ __forceinline__ void add_rows(float* dst, int64_t base, int64_t ld, const rt_fl<BASE, W>& t, int row0,
                                         int l) {
#pragma unroll
  for (int j = 0; j < W / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = row0 + base_row<row_layout>(k, 0), col = BASE * j + base_col<row_layout>(k, 0);
      if (r < l) atomicAdd(reinterpret_cast<float2*>(dst + base + r * ld + col), t.tiles[0][j].data[k]);
    }
}

// A task's two heads add into the same rows of dB or dC (one group): its warpgroups sum their tiles first and each
// adds half the columns, which halves the fp32 atomics. Each hands its partner the other half through shared memory
// (one buffer: double-buffering would pass the shared memory a block may have), between barriers of the two
// warpgroups: the partner has read the previous chunk's half before it is written again.
template <int NS>
struct PairSum {
  float half[HEADS][PT][NS / 2];  // [writer][row][column in the half, swizzled by the row]
};
constexpr int PAIR_BARRIER = 1 + HEADS;  // (named barriers 1..HEADS are the warpgroups' own)

// add_rows for warpgroup wg's tile t of rows row0 + 16·warp + r: with a partner (the other head of the task exists),
// the pair's sum, wg adding columns [wg·NS/2, (wg + 1)·NS/2). t is overwritten.
template <int NS>
__device__ __forceinline__ void add_rows_paired(float* dst, int64_t base, int64_t ld, rt_fl<BASE, NS>& t,
                                                PairSum<NS>& ps, bool partner, int row0, int l) {
  // (a 16-column tile cannot be split in column halves of whole tiles: its heads add separately)
  if (!partner || NS < 2 * BASE) return add_rows(dst, base, ld, t, row0 + BASE * warpid_in_group(), l);
  const int wg = lcsf::consumer_id(), half = NS / 2;
  auto slot = [&](int writer, int j, int k) -> float2& {
    const int r = BASE * warpid_in_group() + base_row<row_layout>(k, 0), c = (BASE * j + base_col<row_layout>(k, 0)) % half;
    return *reinterpret_cast<float2*>(&ps.half[writer][r][c ^ (((r & 3) << 3) % half)]);  // few-conflict float2s
  };
  constexpr int J = NS / BASE;
  named_sync(PAIR_BARRIER, HEADS * WARPGROUP_THREADS);  // the partner has read the previous chunk's half
#pragma unroll
  for (int j = 0; j < J; ++j)
    if ((j < J / 2) != (wg == 0))  // the partner's half
#pragma unroll
      for (int k = 0; k < 4; ++k) slot(wg, j, k) = t.tiles[0][j].data[k];
  named_sync(PAIR_BARRIER, HEADS * WARPGROUP_THREADS);
#pragma unroll
  for (int j = 0; j < J; ++j)
    if ((j < J / 2) == (wg == 0))
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 o = slot(1 - wg, j, k);
        float2& v = t.tiles[0][j].data[k];
        v.x += o.x, v.y += o.y;
        const int r = row0 + BASE * warpid_in_group() + base_row<row_layout>(k, 0);
        if (r < l) atomicAdd(reinterpret_cast<float2*>(dst + base + r * ld + BASE * j + base_col<row_layout>(k, 0)), v);
      }
}

// Adds per-token values (the lane's rows r0 and r0 + 8) to a (b, l, nh) tensor at `base` (its element (b, 0, h)); one
// lane per quad; rows past l skipped.
__device__ __forceinline__ void add_token_sums(float* dst, int64_t base, int nh, float2 v, int r0, int l) {
  if ((laneid() & 3) != 0) return;
  if (r0 < l) atomicAdd(dst + base + int64_t(r0) * nh, v.x);
  if (r0 + 8 < l) atomicAdd(dst + base + int64_t(r0 + 8) * nh, v.y);
}

// Σ over the columns of t(row, ·)·other(row, ·), other a bf16 chunk tile in shared memory with t's columns, for the
// lane's two rows r0 and r0 + 8 (r0 = 16·warp + lane/4), summed over the quad of lanes sharing those rows.
template <int W, class ST>
__device__ __forceinline__ float2 row_dots(const rt_fl<BASE, W>& t, const ST& other, int r0) {
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < W / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = r0 + 8 * (k & 1), col = BASE * j + base_col<row_layout>(k, 0);
      const float2 o = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(&other(r, col)));
      sum[k & 1] += t.tiles[0][j].data[k].x * o.x + t.tiles[0][j].data[k].y * o.y;
    }
  return make_float2(quad_sum(sum[0]), quad_sum(sum[1]));
}

// Kernel A: dC and its per-token sums C·dC, and the chunk-end states.
template <int NS>
struct ssd_bwd_dc : Scan<NS, true, false, 2, BwdGlobals<NS>> {
  using globals = BwdGlobals<NS>;
  using input_block = Chunk<NS, true>;
  struct scratch_block {
    state_tile<NS> h[HEADS];
    PairSum<NS> dc;
    Table table[HEADS][WARPGROUP_WARPS];
  };
  struct state {
    state_acc<NS> h;
  };

  __device__ static void compute(state& s, input_block& in, scratch_block& sc, const globals& g, const lcsf::task& t,
                                 int it) {
    const Shape& sh = g.in.shape;
    const int wg = lcsf::consumer_id(), bar = 1 + wg;
    const Slot sl = slot_of(sh, t, wg);
    const int h = sl.h;
    if (h < 0) return;
    if (it == 0) {
      enter_state<NS, false>(s.h, g.h0, g.fwd, sh, t, sl);
      publish_state(sc.h[wg], s.h, bar);
    }
    const x_tile &x = in.x[wg], &dy = in.dy[wg];
    rt_fl<BASE, CHUNK> m;  // dy_t · x_s
    rt_fl<BASE, NS> dc;    // dy_t · h, then dC_t
    warpgroup::mm_ABt(m, dy, x);
    warpgroup::mm_AB(dc, dy, sc.h[wg]);

    const Decays d = chunk_decays(in.dt[wg], g.A, h);
    Table& tb = sc.table[wg][warpid_in_group()];
    fill_update(tb, d);  // weights: the forward's update
    const int row0 = BASE * warpid_in_group(), t0 = row0 + (laneid() >> 2);
    const float lt[2] = {tb.lam[t0], tb.lam[t0 + 8]};
    rt_bf<BASE, CHUNK> xw;
    weighted_transpose(xw, x, tb);

    warpgroup::mma_async_wait<1>(m);  // (dy h may still run)
    rt_bf<BASE, CHUNK> w;  // (dy_t·x_s) exp(Λ_t − Λ_s) dt_s on and below the diagonal
    decay_mask<false, true>(w, m, tb, lt, {1.f, 1.f}, row0);
    warpgroup::mma_async_wait<0>(dc);
    mul_row(dc, dc, rows(__expf(lt[0]), __expf(lt[1])));
    mul(s.h, s.h, __expf(d.l_end));
    warpgroup::mma_AB(dc, w, in.b);
    warpgroup::mma_AB(s.h, xw, in.b);
    warpgroup::mma_async_wait<0>(dc, s.h, w, xw);

    const int c = ssd_bwd_dc::chunk_of(g, t, it), tok0 = c * CHUNK, b = t.coord[0];
    add_token_sums(g.dlam, int64_t(b) * sh.l * sh.nh + h, sh.nh, row_dots(dc, in.c, t0), tok0 + t0, sh.l);
    add_rows_paired(g.dC, (int64_t(b) * sh.l * sh.ng + t.coord[1]) * NS, int64_t(sh.ng) * NS, dc, sc.dc,
                    slot_of(sh, t, 1 - wg).h >= 0, tok0, sh.l);
    // the chunk-end state: its bf16 copy for kernel B (registers' order) and for the next chunk here
    rt_bf<BASE, NS> hb;
    copy(hb, s.h);
    uint4* out = chunk_state(g, t, sl, c);
#pragma unroll
    for (int j = 0; j < NS / 16; ++j) {
      const auto& r = hb.tiles[0][j].data;
      out[j * WARPGROUP_THREADS] = make_uint4(as_u32(r[0]), as_u32(r[1]), as_u32(r[2]), as_u32(r[3]));
    }
    warpgroup::sync(bar);  // every warp's wgmmas have read the old copy
    warpgroup::store(sc.h[wg], hb);
    fence_async_shared();
    warpgroup::sync(bar);
  }
  __device__ static void store(state&, scratch_block&, const globals&, const lcsf::task&) {}
};

// Kernel B: dx, dB, dh0, the chunk anchors and the per-token sums.
template <int NS>
struct ssd_bwd_dxdb : Scan<NS, true, true, 2, BwdGlobals<NS>> {
  using globals = BwdGlobals<NS>;
  using input_block = Chunk<NS, true>;
  struct scratch_block {
    state_tile<NS> g[HEADS];
    PairSum<NS> db;
    Table table[HEADS][WARPGROUP_WARPS];
  };
  struct state {
    state_acc<NS> g;
    float x_dy;  // this thread's share of Σ x·dy (dD)
  };

  __device__ static void compute(state& s, input_block& in, scratch_block& sc, const globals& g, const lcsf::task& t,
                                 int it) {
    const Shape& sh = g.in.shape;
    const int wg = lcsf::consumer_id(), bar = 1 + wg;
    const Slot sl = slot_of(sh, t, wg);
    const int h = sl.h;
    if (h < 0) return;
    const int c = ssd_bwd_dxdb::chunk_of(g, t, it), b = t.coord[0];
    if (it == 0) {
      enter_state<NS, true>(s.g, g.dh, g.rev, sh, t, sl);
      publish_state(sc.g[wg], s.g, bar);
      s.x_dy = 0.f;
    }
    // kernel A's copy of h at the chunk's end, in this thread's registers' order, for the anchor ⟨g, h⟩ there (read
    // now, used once the wgmmas below have been waited for: g may not be read while they run)
    uint4 hs[NS / 16];
#pragma unroll
    for (int j = 0; j < NS / 16; ++j) hs[j] = chunk_state(g, t, sl, c)[j * WARPGROUP_THREADS];
    const x_tile &x = in.x[wg], &dy = in.dy[wg];
    rt_fl<BASE, PT> dX;     // B_s · gᵀ, then dX_s
    rt_fl<BASE, CHUNK> bc;  // B_s · C_t
    warpgroup::mm_ABt(bc, in.b, in.c);
    warpgroup::mm_ABt(dX, in.b, sc.g[wg]);
    const Decays d = chunk_decays(in.dt[wg], g.A, h);
    Table& tb = sc.table[wg][warpid_in_group()];
    fill_reverse(tb, d);  // weights: g's update
    const int row0 = BASE * warpid_in_group(), s0 = row0 + (laneid() >> 2);  // rows s0 and s0 + 8
    const float ls[2] = {tb.lam[s0], tb.lam[s0 + 8]}, dts[2] = {tb.dt[s0], tb.dt[s0 + 8]};
    const float to_end[2] = {__expf(d.l_end - ls[0]), __expf(d.l_end - ls[1])};

    warpgroup::mma_async_wait<1>(bc);  // (B gᵀ may still run)
    rt_bf<BASE, CHUNK> pw;  // (B_s·C_t) exp(Λ_t − Λ_s) on and above the diagonal
    decay_mask<true, false>(pw, bc, tb, ls, {1.f, 1.f}, row0);
    warpgroup::mma_async_wait<0>(dX);
    {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < NS / 16; ++j) {
        const uint32_t words[4] = {hs[j].x, hs[j].y, hs[j].z, hs[j].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // the bf16 pair of register e of tile j
          const float2 hv = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(&words[e]));
          sum += s.g.tiles[0][j].data[e].x * hv.x + s.g.tiles[0][j].data[e].y * hv.y;
        }
      }
      sum = warp_sum(sum);
      if (laneid() == 0) atomicAdd(g.anchor + (int64_t(b) * sh.nh + h) * sh.chunks + c, sum);
    }
    mul_row(dX, dX, rows(to_end[0], to_end[1]));
    warpgroup::mma_AB(dX, pw, dy);
    warpgroup::mma_async_wait<0>(dX, pw);

    const int tok0 = c * CHUNK;
    const int64_t tok_base = int64_t(b) * sh.l * sh.nh + h;  // (b, 0, h) of a (b, l, nh) tensor
    {  // dx = dt·dX + D·dy in bf16; Σ_p x·dX per token; Σ x·dy for dD
      const float Dh = g.D ? g.D[h] : 0.f;
      const int64_t ld = int64_t(sh.nh) * sh.p, base = int64_t(b) * sh.l * ld + sl.tile * PT;
#pragma unroll
      for (int j = 0; j < PT / BASE; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int rr = s0 + 8 * (k & 1), col = BASE * j + base_col<row_layout>(k, 0), r = tok0 + rr;
          const float2 v = dX.tiles[0][j].data[k];
          const float2 dyv = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(&dy(rr, col)));
          const float2 xv = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(&x(rr, col)));
          s.x_dy += xv.x * dyv.x + xv.y * dyv.y;  // rows past l are zero-filled
          if (r < sh.l)
            *reinterpret_cast<bf16_2*>(g.dx + base + r * ld + col) =
                __floats2bfloat162_rn(dts[k & 1] * v.x + Dh * dyv.x, dts[k & 1] * v.y + Dh * dyv.y);
        }
      if (g.xdX) add_token_sums(g.xdX, tok_base, sh.nh, row_dots(dX, x, s0), tok0 + s0, sh.l);
    }

    rt_fl<BASE, NS> db;    // x_s · g, then dB_s
    rt_fl<BASE, CHUNK> q;  // x_s · dy_t
    warpgroup::mm_ABt(q, x, dy);
    warpgroup::mm_AB(db, x, sc.g[wg]);
    rt_bf<BASE, CHUNK> dyw;  // dyᵀ with token t scaled by exp(Λ_t): g's update
    weighted_transpose(dyw, dy, tb);
    warpgroup::mma_async_wait<1>(q);  // (x g may still run)
    rt_bf<BASE, CHUNK> qw;  // (x_s·dy_t) exp(Λ_t − Λ_s) dt_s on and above the diagonal
    decay_mask<true, false>(qw, q, tb, ls, dts, row0);
    warpgroup::mma_async_wait<0>(db);
    mul_row(db, db, rows(to_end[0] * dts[0], to_end[1] * dts[1]));
    mul(s.g, s.g, __expf(d.l_end));
    warpgroup::mma_AB(db, qw, in.c);
    warpgroup::mma_AB(s.g, dyw, in.c);
    warpgroup::mma_async_wait<0>(db, s.g, qw, dyw);

    const float2 bdb = row_dots(db, in.b, s0);
    add_token_sums(g.dlam, tok_base, sh.nh, make_float2(-bdb.x, -bdb.y), tok0 + s0, sh.l);
    add_rows_paired(g.dB, (int64_t(b) * sh.l * sh.ng + t.coord[1]) * NS, int64_t(sh.ng) * NS, db, sc.db,
                    slot_of(sh, t, 1 - wg).h >= 0, tok0, sh.l);
    warpgroup::sync(bar);  // every warp's wgmmas have read the old copy of g
    publish_state(sc.g[wg], s.g, bar);
  }

  __device__ static void store(state& s, scratch_block&, const globals& g, const lcsf::task& t) {
    const Slot sl = slot_of(g.in.shape, t, lcsf::consumer_id());
    if (sl.h < 0) return;
    if (t.coord[3] == 0) write_state<NS>(g.dh0, s.g, state_base<NS>(g.in.shape, t, sl));  // the sequence's start
    if (g.dD) {
      const float sum = warp_sum(s.x_dy);
      if (laneid() == 0) atomicAdd(g.dD + sl.h, sum);
    }
  }
};

template <int NS>
const char* run(const BwdArgs& a, cudaStream_t stream) {
  BwdGlobals<NS> g{};
  const Shape sh = shape_of(a.b, a.l, a.l_pad, a.nh, a.ng, a.p, HEADS, a.segments);
  if (sh.segments != (sh.chunks + sh.seg_chunks - 1) / sh.seg_chunks) return "segments must split the chunks evenly";
  if (const char* e = make_stream(g.in, a.x, a.dy, a.B, a.C, a.dt, sh)) return e;
  g.A = a.A, g.D = a.D, g.h0 = a.h0, g.dh = a.dh;
  g.dx = static_cast<bf16*>(a.dx), g.dB = a.dB, g.dC = a.dC, g.dlam = a.dlam, g.xdX = a.xdX, g.dD = a.dD;
  g.dh0 = a.dh0, g.anchor = a.anchor, g.chunk_states = static_cast<uint4*>(a.chunk_states);
  g.fwd = {a.seg_states, a.seg_decay}, g.rev = {a.seg_grads, a.seg_decay};  // (both passes give the same decays)
  if (tasks_of(sh) > 0x7fffffff) return "too many (batch, head, head-dim tile, segment) tasks";
  const bool split = sh.segments > 1;
  cudaError_t e = split ? launch_segment_states<NS, false>(g.in, a.A, g.fwd, stream) : cudaSuccess;
  if (e == cudaSuccess) e = lcsf::launch<ssd_bwd_dc<NS>>(g, int(tasks_of(sh)), stream);
  if (e == cudaSuccess && split) e = launch_segment_states<NS, true>(g.in, a.A, g.rev, stream);
  if (e == cudaSuccess) e = lcsf::launch<ssd_bwd_dxdb<NS>>(g, int(tasks_of(sh)), stream);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

const char* launch_backward(const BwdArgs& a, cudaStream_t stream) {
  if (a.p <= 0 || a.p % P_TILE != 0) return "the head dim p must be a positive multiple of 64";
  if (a.ng <= 0 || a.nh % a.ng != 0) return "nh must be a multiple of ng";
  if (a.b <= 0 || a.nh <= 0) return nullptr;  // nothing to compute
  if (a.l <= 0) return "l must be >= 1 (the binding handles empty sequences)";
  if (a.l_pad < a.l || a.l_pad % CHUNK != 0) return "dt must be padded to whole chunks of 64";
  if (a.segments < 1 || (a.segments > 1 && (!a.seg_states || !a.seg_grads || !a.seg_decay)))
    return "a split sequence (segments > 1) needs the segment scratch";
  if (a.n == 16) return run<16>(a, stream);
  if (a.n == 32) return run<32>(a, stream);
  if (a.n == 64) return run<64>(a, stream);
  if (a.n == 128) return run<128>(a, stream);
  return "the state size n must be 16, 32, 64 or 128";
}

}  // namespace tk_ssd
