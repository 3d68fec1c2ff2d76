// Mamba-2 SSD backward (ssd.h): the gradients of X = dt·x, B, C and the initial state as two chunked scans of the
// forward's shape; README "Backward" has the plan. Per (batch, head, tile of PT = 64 or 32 head dims), with Λ the
// inclusive cumulative sum of a = dt·A inside the chunk:
//   kernel A, chunks first to last over S = hᵀ (the forward's state, n x p):
//     dC_t = Σ_{s≤t} exp(Λ_t − Λ_s) (dy_t·X_s) B_s + exp(Λ_t) S dy_t
//   kernel B, chunks last to first over G = gᵀ, g = ∂L/∂h at the chunk's end (from dh_final):
//     dX_s = Σ_{t≥s} exp(Λ_t − Λ_s) (B_s·C_t) dy_t + exp(Λ_end − Λ_s) Gᵀ B_s
//     dB_s = Σ_{t≥s} exp(Λ_t − Λ_s) (X_s·dy_t) C_t + exp(Λ_end − Λ_s) G X_s
//     G   ← exp(Λ_end) G + Σ_t exp(Λ_t) C_t dy_tᵀ;  dh0 = G after chunk 0
// The kernels also reduce what the binding needs, so that no per-head (b, l, nh, n) or fp32 (b, l, nh, p) tensor is
// ever written: dB and dC go straight to their group's rows, and per token dlam = C·dC_h − B·dB_h and Σ_p x·dX, by
// fp32 atomics over heads and head-dim tiles (the binding zeroes them); kernel B writes dx = dt·dX + D·dy in bf16 and
// sums dD = Σ x·dy. The binding then forms dt's and A's gradients: da is dlam summed from the back inside each chunk,
// plus the chunk's anchor ⟨g, h⟩ at its end (all later tokens' share, exactly). Summing over the whole sequence
// instead accumulates bf16 rounding over thousands of nearly cancelling terms (measured: A's gradient 4–13% off at
// 300 tokens). For the anchor, kernel A writes each chunk-end state h (its bf16 copy, as stored in shared memory)
// and kernel B dots it with its copy of g, tile against tile in the same layout.
// Warps: 8. Outputs: warp w owns chunk rows 16·(w/2).. and half of the columns (head dims for dX, state dims for
// dB and dC); the state: warp w < n/16 owns 16 state dims of S or G in fp32 registers, as in the forward.
#include "ssd.cuh"

namespace tk_ssd {
namespace {

template <int NS, int PT>
struct BwdSmem {
  static_assert(PT % 32 == 0 && CHUNK * PT / 8 % THREADS == 0, "a block takes 32 or 64 head dims");
  st<bf16, CHUNK, PT> x[2], dy[2];
  st<bf16, CHUNK, NS> b[2], c[2];
  st<bf16, NS, PT> state;  // bf16 copy of S (kernel A) or G (kernel B) before the current chunk
  st<bf16, NS, PT> h[2];   // kernel B: kernel A's copy of S at the end of the chunk in buffer `buf`
  float dt[2][CHUNK];
};

template <int NS, int PT>
struct BwdRows {  // this block's rows in global memory: the forward's, and dy (x's layout)
  Rows<NS> in;
  const bf16* dy;
};

// Chunk c of x, B, C, dt (the forward's load) and dy into buffer `buf`.
template <int NS, int PT>
__device__ __forceinline__ void load_bwd_chunk(BwdSmem<NS, PT>& s, int buf, const BwdRows<NS, PT>& g, int c) {
  load_chunk(s, buf, g.in, c);
  using XT = st<bf16, CHUNK, PT>;
  const int tid = threadIdx.x, n0 = c * CHUNK;
#pragma unroll
  for (int i = 0; i < CHUNK * PT / 8 / THREADS; ++i) {
    const int t = tid + i * THREADS, r = t / (PT / 8), seg = t % (PT / 8), n = n0 + r;
    const bool ok = n < g.in.l;
    cp_async16(smem_addr(s.dy[buf].data) + XT::offset(r, seg * 8), g.dy + (ok ? n * g.in.x_row + seg * 8 : 0), ok);
  }
  cp_async_commit();
}

// The bf16 state tiles of chunk c's end in a (blocks, chunks, n·PT) buffer, in shared memory's own order: kernel A
// stores its copy of S, kernel B loads it (one cp.async group) and dots it with its copy of G.
template <int NS, int PT>
__device__ __forceinline__ bf16* chunk_state(const BwdArgs& a, int c) {
  const int chunks = (a.l + CHUNK - 1) / CHUNK;
  return static_cast<bf16*>(a.chunk_states) + (int64_t(blockIdx.x) * chunks + c) * (NS * PT);
}

template <int NS, int PT>
__device__ __forceinline__ void store_chunk_state(const BwdSmem<NS, PT>& s, const BwdArgs& a, int c) {
  const uint4* src = reinterpret_cast<const uint4*>(s.state.data);
  uint4* dst = reinterpret_cast<uint4*>(chunk_state<NS, PT>(a, c));
#pragma unroll
  for (int i = threadIdx.x; i < NS * PT / 8; i += THREADS) dst[i] = src[i];
}

template <int NS, int PT>
__device__ __forceinline__ void load_chunk_state(BwdSmem<NS, PT>& s, int buf, const BwdArgs& a, int c) {
  const bf16* src = chunk_state<NS, PT>(a, c);
#pragma unroll
  for (int i = threadIdx.x; i < NS * PT / 8; i += THREADS) cp_async16(smem_addr(s.h[buf].data) + 16 * i, src + 8 * i);
  cp_async_commit();
}

// ⟨G, h⟩ over the block's tile (both bf16 in shared memory, same layout), added to the anchor of chunk c.
template <int NS, int PT>
__device__ __forceinline__ void add_anchor(const BwdSmem<NS, PT>& s, int buf, const BwdArgs& a, int c) {
  const bf16_2* g = reinterpret_cast<const bf16_2*>(s.state.data);
  const bf16_2* h = reinterpret_cast<const bf16_2*>(s.h[buf].data);
  float sum = 0.f;
#pragma unroll
  for (int i = threadIdx.x; i < NS * PT / 2; i += THREADS) {
    const float2 gf = __bfloat1622float2(g[i]), hf = __bfloat1622float2(h[i]);
    sum += gf.x * hf.x + gf.y * hf.y;
  }
  sum = warp_sum(sum);
  const int chunks = (a.l + CHUNK - 1) / CHUNK, bh = blockIdx.x / (a.p / PT);
  if (laneid() == 0) atomicAdd(a.anchor + int64_t(bh) * chunks + c, sum);
}

// state ← keep·state + Σ_t weight(t) rows_tᵀ values_t for this owner warp's 16 state dims, then published: rows
// (tokens x n) is B with values x and weight exp(Λ_end − Λ_t) dt_t for h (kernel A; the forward's update, written
// inline there), or C with values dy and weight exp(Λ_t) for ∂L/∂h (kernel B). weight gets a column index (one
// parity in every lane: Decays' *_col lookups apply).
template <int NS, int PT, class S, class Weight>
__device__ __forceinline__ void state_step(rt_fl<BASE, PT>& state, S& s, const st<bf16, CHUNK, NS>& rows,
                                           const st<bf16, CHUNK, PT>& values, float keep, Weight&& weight) {
  const int warp = warpid();
#pragma unroll
  for (int j = 0; j < PT / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) state.tiles[0][j].data[k].x *= keep, state.tiles[0][j].data[k].y *= keep;
#pragma unroll
  for (int j = 0; j < CHUNK / BASE; ++j) {
    // tokens 16j.. by this warp's 16 state dims, loaded in col layout: the registers of its transpose
    rt_bf<BASE, BASE, col_layout> rt;
    load(rt, rows, BASE * j, BASE * warp);
    rt_bf<BASE, BASE> wr;  // rowsᵀ with each token's column scaled by its weight
    map_indexed(wr, transposed(rt), [&](int, int col, float v) { return v * weight(BASE * j + col); });
    rt_bf<BASE, PT, col_layout> vj;
    load(vj, values, BASE * j, 0);
    mma_AB(state, wr, vj, state);
  }
  publish_state(s, state, warp);
}

// Adds a warp's 16-row fp32 tile to rows row0.. (columns col0..) of a (·, ld) fp32 matrix; rows at or past l skipped.
template <int W>
__device__ __forceinline__ void add_rows(float* dst, int64_t ld, const rt_fl<BASE, W>& t, int row0, int l,
                                         int col0) {
#pragma unroll
  for (int j = 0; j < W / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = row0 + base_row<row_layout>(k, 0), col = col0 + BASE * j + base_col<row_layout>(k, 0);
      if (r >= l) continue;
      atomicAdd(dst + int64_t(r) * ld + col, t.tiles[0][j].data[k].x);
      atomicAdd(dst + int64_t(r) * ld + col + 1, t.tiles[0][j].data[k].y);
    }
}

// Σ over this warp's columns col0.. of t(row, ·)·other(row, ·), other a bf16 shared tile of the chunk, for the lane's
// two rows r0 = 16·(its row tile) + lane/4 and r0 + 8; summed over the quad of lanes sharing those rows.
template <int W, class ST>
__device__ __forceinline__ float2 row_dots(const rt_fl<BASE, W>& t, const ST& other, int r0, int col0) {
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < W / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = r0 + 8 * (k & 1), col = col0 + BASE * j + base_col<row_layout>(k, 0);
      const float2 o = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(&other(r, col)));
      sum[k & 1] += t.tiles[0][j].data[k].x * o.x + t.tiles[0][j].data[k].y * o.y;
    }
  return make_float2(quad_sum(sum[0]), quad_sum(sum[1]));
}

// Adds `sign`·row_dots to the per-token (b, l, nh) sums at chunk rows r0 and r0 + 8 (one lane per quad; rows at or
// past l skipped).
__device__ __forceinline__ void add_token_sums(float* dst, int64_t ld, float2 v, int row0, int l) {
  if ((laneid() & 3) != 0) return;
  if (row0 < l) atomicAdd(dst + int64_t(row0) * ld, v.x);
  if (row0 + 8 < l) atomicAdd(dst + int64_t(row0 + 8) * ld, v.y);
}

template <int NS, int PT>
struct Block {  // a block's (batch, head, head-dim tile) and its pointers
  BwdRows<NS, PT> g;
  int64_t out_row_p, out_row_n, state_base;
  int64_t p_off, n_off;  // offsets of the block's first row in the (b, l, nh, p) and (b, l, ng, n) outputs
  int64_t tok_off;        // ... and in the (b, l, nh) per-token sums (row stride nh)
  int h;
  float Ah;
};

template <int NS, int PT>
__device__ __forceinline__ Block<NS, PT> block_of(const BwdArgs& a) {
  const int ptiles = a.p / PT;
  const int pt = blockIdx.x % ptiles, bh = blockIdx.x / ptiles;
  const int bi = bh / a.nh, h = bh % a.nh, grp_of_head = h / (a.nh / a.ng);
  Block<NS, PT> k;
  k.p_off = (int64_t(bi) * a.l * a.nh + h) * a.p + pt * PT;
  k.n_off = (int64_t(bi) * a.l * a.ng + grp_of_head) * NS;  // the group's B / C rows
  k.tok_off = int64_t(bi) * a.l * a.nh + h, k.h = h;
  k.g.in.x = static_cast<const bf16*>(a.x) + k.p_off;
  k.g.dy = static_cast<const bf16*>(a.dy) + k.p_off;
  k.g.in.b = static_cast<const bf16*>(a.B) + (int64_t(bi) * a.l * a.ng + grp_of_head) * NS;
  k.g.in.c = static_cast<const bf16*>(a.C) + (int64_t(bi) * a.l * a.ng + grp_of_head) * NS;
  k.g.in.dt = a.dt + int64_t(bi) * a.l * a.nh + h;
  k.g.in.x_row = int64_t(a.nh) * a.p, k.g.in.bc_row = int64_t(a.ng) * NS, k.g.in.dt_row = a.nh;
  k.g.in.l = a.l;
  k.out_row_p = int64_t(a.nh) * a.p, k.out_row_n = int64_t(a.ng) * NS;
  k.state_base = (int64_t(bh) * a.p + pt * PT) * NS;
  k.Ah = a.A[h];
  return k;
}

// Kernel A: dC and its per-token sums, and the chunk-end states.
template <int NS, int PT>
__global__ void __launch_bounds__(THREADS, 1) ssd_bwd_dc_kernel(const BwdArgs a) {
  extern __shared__ uint8_t raw[];
  BwdSmem<NS, PT>& s = *reinterpret_cast<BwdSmem<NS, PT>*>(align_shared<1024>(raw));
  constexpr int NH = NS / 2;  // state dims per output warp
  const Block<NS, PT> blk = block_of<NS, PT>(a);
  const int warp = warpid(), lane = laneid(), grp = warp >> 1, ncols = NH * (warp & 1);
  const bool owner = warp < NS / BASE;
  load_bwd_chunk(s, 0, blk.g, 0);
  rt_fl<BASE, PT> S;
  read_state<NS, PT>(S, owner ? a.h0 : nullptr, blk.state_base, warp);
  if (owner) publish_state(s, S, warp);
  const int chunks = (a.l + CHUNK - 1) / CHUNK;
  for (int c = 0; c < chunks; ++c) {
    const int buf = c & 1;
    cp_async_wait<0>();
    __syncthreads();  // chunk c and S before it are visible; chunk c - 1's buffers are free
    if (c + 1 < chunks) load_bwd_chunk(s, buf ^ 1, blk.g, c + 1);
    if (c > 0) store_chunk_state(s, a, c - 1);  // S at chunk c - 1's end
    const Decays d = chunk_decays(s, buf, blk.Ah);
    {
      const int t0 = BASE * grp + (lane >> 2);
      const float lt[2] = {d.lam(t0), d.lam(t0 + 8)};
      // intra-chunk: W = (dy_t·x_s) exp(Λ_t − Λ_s) dt_s on and below the diagonal; dC = W B
      rt_bf<BASE, PT> dyr;
      load(dyr, s.dy[buf], BASE * grp, 0);
      rt_bf<CHUNK, PT> xall;
      load(xall, s.x[buf]);
      rt_fl<BASE, CHUNK> m;
      zero(m);
      mma_ABt(m, dyr, xall, m);
      rt_bf<BASE, CHUNK> w;
      causal_decay<false>(w, m, d, lt, BASE * grp, [&](int, int src) { return d.dt_col(src); });
      rt_bf<CHUNK, NH, col_layout> bc;
      load(bc, s.b[buf], 0, ncols);
      rt_fl<BASE, NH> dc;
      zero(dc);
      mma_AB(dc, w, bc, dc);
      // inter-chunk: exp(Λ_t) dy_t against S's rows (the decay folded into dy's rows)
      const float decay[2] = {__expf(lt[0]), __expf(lt[1])};
      map_indexed(dyr, dyr, [&](int r, int, float v) { return v * decay[r >> 3]; });
      rt_bf<NH, PT> sr;
      load(sr, s.state, ncols, 0);
      mma_ABt(dc, dyr, sr, dc);
      add_rows(a.dC + blk.n_off, blk.out_row_n, dc, c * CHUNK + BASE * grp, a.l, ncols);
      add_token_sums(a.dlam + blk.tok_off, a.nh, row_dots(dc, s.c[buf], t0, ncols),
                     c * CHUNK + t0, a.l);
    }
    __syncthreads();  // every warp has read S before its owners change it
    if (owner)  // S ← exp(Λ_end) S + Σ_s exp(Λ_end − Λ_s) dt_s B_sᵀ x_s
      state_step(S, s, s.b[buf], s.x[buf], __expf(d.l_end),
                 [&](int t) { return __expf(d.l_end - d.lam_col(t)) * d.dt_col(t); });
  }
  __syncthreads();  // the last chunk's update is published
  store_chunk_state(s, a, chunks - 1);
}

// Kernel B: dx, dB, dh0, the chunk anchors and the per-token sums.
template <int NS, int PT>
__global__ void __launch_bounds__(THREADS, 1) ssd_bwd_dxdb_kernel(const BwdArgs a) {
  extern __shared__ uint8_t raw[];
  BwdSmem<NS, PT>& s = *reinterpret_cast<BwdSmem<NS, PT>*>(align_shared<1024>(raw));
  constexpr int NH = NS / 2;
  const Block<NS, PT> blk = block_of<NS, PT>(a);
  constexpr int HALF = PT / 2;  // head dims per dx warp
  const int warp = warpid(), lane = laneid(), grp = warp >> 1, pcols = HALF * (warp & 1), ncols = NH * (warp & 1);
  const bool owner = warp < NS / BASE;
  const int chunks = (a.l + CHUNK - 1) / CHUNK;
  const float Dh = a.D ? a.D[blk.h] : 0.f;
  float x_dy = 0.f;  // this lane's share of dD
  load_bwd_chunk(s, (chunks - 1) & 1, blk.g, chunks - 1);
  load_chunk_state(s, (chunks - 1) & 1, a, chunks - 1);
  rt_fl<BASE, PT> G;
  read_state<NS, PT>(G, owner ? a.dh : nullptr, blk.state_base, warp);
  if (owner) publish_state(s, G, warp);
  for (int c = chunks - 1; c >= 0; --c) {
    const int buf = c & 1;
    cp_async_wait<0>();
    __syncthreads();  // chunk c and G at its end are visible; chunk c + 1's buffers are free
    if (c > 0) load_bwd_chunk(s, buf ^ 1, blk.g, c - 1), load_chunk_state(s, buf ^ 1, a, c - 1);
    const Decays d = chunk_decays(s, buf, blk.Ah);
    add_anchor(s, buf, a, c);  // G is g at chunk c's end
    {
      const int s0 = BASE * grp + (lane >> 2);
      const float ls[2] = {d.lam(s0), d.lam(s0 + 8)}, dts[2] = {d.dt(s0), d.dt(s0 + 8)};
      const float to_end[2] = {__expf(d.l_end - ls[0]), __expf(d.l_end - ls[1])};
      // dX, intra-chunk: (B_s·C_t) exp(Λ_t − Λ_s) for t ≥ s, times dy
      rt_fl<BASE, CHUNK> bc;
      zero(bc);
#pragma unroll
      for (int kk = 0; kk < NS / BASE; ++kk) {
        rt_bf<BASE, BASE> bw;
        load(bw, s.b[buf], BASE * grp, BASE * kk);
        rt_bf<CHUNK, BASE> ck;
        load(ck, s.c[buf], 0, BASE * kk);
        mma_ABt(bc, bw, ck, bc);
      }
      rt_bf<BASE, CHUNK> pw;
      causal_decay<true>(pw, bc, d, ls, BASE * grp, [](int, int) { return 1.f; });
      rt_bf<CHUNK, HALF, col_layout> dyc;
      load(dyc, s.dy[buf], 0, pcols);
      rt_fl<BASE, HALF> dx;
      zero(dx);
      mma_AB(dx, pw, dyc, dx);
      // dX, inter-chunk: exp(Λ_end − Λ_s) B_s against G (the decay folded into B's rows)
#pragma unroll
      for (int kk = 0; kk < NS / BASE; ++kk) {
        rt_bf<BASE, BASE> bw;
        load(bw, s.b[buf], BASE * grp, BASE * kk);
        map_indexed(bw, bw, [&](int r, int, float v) { return v * to_end[r >> 3]; });
        rt_bf<BASE, HALF, col_layout> gk;
        load(gk, s.state, BASE * kk, pcols);
        mma_AB(dx, bw, gk, dx);
      }
      {  // dx = dt·dX + D·dy in bf16; Σ_p x·dX per token; Σ x·dy for dD
        float xdx[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < HALF / BASE; ++j)
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int rr = s0 + 8 * (k & 1), col = pcols + BASE * j + base_col<row_layout>(k, 0);
            const float2 v = dx.tiles[0][j].data[k];
            const float2 xv = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(&s.x[buf](rr, col)));
            const float2 dyv = __bfloat1622float2(*reinterpret_cast<const bf16_2*>(&s.dy[buf](rr, col)));
            xdx[k & 1] += xv.x * v.x + xv.y * v.y;
            x_dy += xv.x * dyv.x + xv.y * dyv.y;  // rows past l are zero-filled
            const int r = c * CHUNK + rr;
            if (r >= a.l) continue;
            *reinterpret_cast<bf16_2*>(static_cast<bf16*>(a.dx) + blk.p_off + r * blk.out_row_p + col) =
                __floats2bfloat162_rn(dts[k & 1] * v.x + Dh * dyv.x, dts[k & 1] * v.y + Dh * dyv.y);
          }
        add_token_sums(a.xdX + blk.tok_off, a.nh, make_float2(quad_sum(xdx[0]), quad_sum(xdx[1])), c * CHUNK + s0, a.l);
      }

      // dB, intra-chunk: (x_s·dy_t) exp(Λ_t − Λ_s) dt_s for t ≥ s, times C
      rt_bf<BASE, PT> xr;
      load(xr, s.x[buf], BASE * grp, 0);
      rt_bf<CHUNK, PT> dyall;
      load(dyall, s.dy[buf]);
      rt_fl<BASE, CHUNK> q;
      zero(q);
      mma_ABt(q, xr, dyall, q);
      rt_bf<BASE, CHUNK> qw;
      causal_decay<true>(qw, q, d, ls, BASE * grp, [&](int r, int) { return dts[r >> 3]; });
      rt_bf<CHUNK, NH, col_layout> cc;
      load(cc, s.c[buf], 0, ncols);
      rt_fl<BASE, NH> db;
      zero(db);
      mma_AB(db, qw, cc, db);
      // dB, inter-chunk: exp(Λ_end − Λ_s) dt_s x_s against G's rows
      map_indexed(xr, xr, [&](int r, int, float v) { return v * to_end[r >> 3] * dts[r >> 3]; });
      rt_bf<NH, PT> gr;
      load(gr, s.state, ncols, 0);
      mma_ABt(db, xr, gr, db);
      add_rows(a.dB + blk.n_off, blk.out_row_n, db, c * CHUNK + BASE * grp, a.l, ncols);
      const float2 bdb = row_dots(db, s.b[buf], s0, ncols);
      add_token_sums(a.dlam + blk.tok_off, a.nh, make_float2(-bdb.x, -bdb.y), c * CHUNK + s0, a.l);
    }
    __syncthreads();  // every warp has read G before its owners change it
    if (owner)  // G ← exp(Λ_end) G + Σ_t exp(Λ_t) C_t dy_tᵀ: ∂L/∂h at the chunk's start
      state_step(G, s, s.c[buf], s.dy[buf], __expf(d.l_end), [&](int t) { return __expf(d.lam_col(t)); });
  }
  if (owner) write_state<NS, PT>(a.dh0, G, blk.state_base, warp);
  if (a.dD) {
    x_dy = warp_sum(x_dy);
    if (lane == 0) atomicAdd(a.dD + blk.h, x_dy);
  }
}

template <int NS, int PT, class Kernel>
const char* launch_bwd(Kernel kernel, const BwdArgs& a, cudaStream_t stream) {
  const int64_t blocks = int64_t(a.b) * a.nh * (a.p / PT);
  if (blocks > 0x7fffffff) return "too many (batch, head, head-dim tile) blocks for one launch";
  const size_t smem = sizeof(BwdSmem<NS, PT>) + 1024;
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (attr != cudaSuccess) return cudaGetErrorString(attr);
  kernel<<<unsigned(blocks), THREADS, smem, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <int NS, int PT>
const char* launch_bwd_n(const BwdArgs& a, cudaStream_t stream) {
  if (const char* err = launch_bwd<NS, PT>(ssd_bwd_dc_kernel<NS, PT>, a, stream)) return err;
  return launch_bwd<NS, PT>(ssd_bwd_dxdb_kernel<NS, PT>, a, stream);
}

}  // namespace

const char* launch_backward(const BwdArgs& a, cudaStream_t stream) {
  if (a.p <= 0 || a.p % P_TILE != 0) return "the head dim p must be a positive multiple of 64";
  if (a.ng <= 0 || a.nh % a.ng != 0) return "nh must be a multiple of ng";
  if (a.b <= 0 || a.nh <= 0) return nullptr;  // nothing to compute
  if (a.l <= 0) return "l must be >= 1 (the binding handles empty sequences)";
  // 32 head dims per block (twice the blocks) where the forward takes them, a grid of 64-head-dim blocks filling at
  // most half the SMs. Measured on the H200 (RESULTS.md), fwd+bwd: b1 l4096 nh32 1.28 ms vs 1.43; at b16 nh80
  // (1280 blocks) 21.0 ms vs 13.5.
  const long long blocks = (long long)a.b * a.nh * (a.p / P_TILE);
  const bool p32 = 2 * blocks <= tk::grid::sm_count();
  if (a.n == 64) return p32 ? launch_bwd_n<64, 32>(a, stream) : launch_bwd_n<64, 64>(a, stream);
  if (a.n == 128) return p32 ? launch_bwd_n<128, 32>(a, stream) : launch_bwd_n<128, 64>(a, stream);
  return "the state size n must be 64 or 128";
}

}  // namespace tk_ssd
