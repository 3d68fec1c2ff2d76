// Based linear attention, backward (linear_attention.h): the gradients as two chunked scans like the forward's.
#include "based.cuh"

#include <tk/ops/thread/cp_async.cuh>

namespace tk_linear_attention {
namespace {

constexpr int WARPS = 8, THREADS = WARPS * 32;
constexpr int TILES = 18, FEATURES = TILES * BASE;   // 256 quadratic + 16 linear + 1 constant (+ 15 zero rows)
constexpr int OWNED = (TILES + WARPS - 1) / WARPS;  // state tiles per warp: 3 for warps 0-1, 2 for the others
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
// reverse scan adds φq(q)ᵀ dn and r = Σ dd φq.
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


// Two scans per (batch·head, tile of 64 value columns); README "How the two backward kernels map onto the forward's
// tiles" has the equations. With dn = do/(d + eps), dd = -(do·o)/(d + eps) (dn = do, dd = 0 without normalising)
// and g_ij = dn_i·v_j + dd_i:
//   kernel A, chunks first to last, the forward's state H = Σ φk vᵀ and z = Σ φk:
//     dq_i = scale Σ_{j≤i, this chunk} g_ij (1 + s_ij) k_j + J_φq(q_i)ᵀ (H dn_i + z dd_i)
//   kernel B, chunks last to first, the state R = Σ φq dnᵀ and r = Σ φq dd over the later chunks:
//     dv_j = Σ_{i≥j, this chunk} κ_ij dn_i + R ᵀφk(k_j)
//     dk_j = scale Σ_{i≥j, this chunk} g_ij (1 + s_ij) q_i + J_φk(k_j)ᵀ (R v_j + r)
// Everything but the denominator is linear in the value columns, so each warp of a pair takes half of the block's
// columns and adds its partial dq / dk (fp32, with the other value tiles') by atomics; dv has no sum.
// DVT: value columns per block (64, or 32 for twice the blocks).
template <int DVT>
struct BwdSmem {
  static_assert(DVT % 32 == 0 && CHUNK * DVT / 8 % THREADS == 0, "a block takes 32 or 64 value columns");
  QKTile q[2], k[2];
  VTile<DVT> v[2], dout[2];
  VTile<DVT> dn;              // do / (d + eps), this chunk
  StateTile<DVT> state;       // A: H, B: R (bf16 copy before the current chunk)
  float z[FEATURES];              // A: z = Σ φk; B: r = Σ φq dd
  float delta[2][CHUNK];          // do·o per row (zero without normalising)
  float inv[2][CHUNK];            // B: 1/(d + eps) per row, from kernel A
  float dd[CHUNK];                // this chunk's dd
};

struct BwdRows {
  Rows in;           // q, k, v
  const bf16* dout;  // (N, dv) rows of the block's (batch, head), at its column tile
  const float* delta;
  const float* inv;  // B reads it
  int dv;
};

template <int DVT>
__device__ __forceinline__ void load_bwd_chunk(BwdSmem<DVT>& s, int buf, const BwdRows& g, int c, bool with_inv) {
  const int tid = threadIdx.x, n0 = c * CHUNK;
  {
    const bool is_q = tid < 128;
    const int t = tid & 127, r = t >> 1, seg = t & 1, n = n0 + r;
    const bool ok = n < g.in.N;
    const bf16* src = (is_q ? g.in.q : g.in.k) + (ok ? int64_t(n) * (is_q ? g.in.qn : g.in.kn) + seg * 8 : 0);
    const QKTile& dst = is_q ? s.q[buf] : s.k[buf];
    cp_async16(smem_addr(dst.data) + QKTile::offset(r, seg * 8), src, ok);
  }
#pragma unroll
  for (int i = 0; i < CHUNK * DVT / 8 / THREADS; ++i) {
    const int t = tid + i * THREADS, r = t / (DVT / 8), seg = t % (DVT / 8), n = n0 + r;
    const bool ok = n < g.in.N;
    const int off = VTile<DVT>::offset(r, seg * 8);
    cp_async16(smem_addr(s.v[buf].data) + off, g.in.v + (ok ? int64_t(n) * g.in.vn + seg * 8 : 0), ok);
    cp_async16(smem_addr(s.dout[buf].data) + off, g.dout + (ok ? int64_t(n) * g.dv + seg * 8 : 0), ok);
  }
  if (tid < CHUNK) {
    const bool ok = n0 + tid < g.in.N;
    const bool has_delta = ok && g.delta != nullptr;  // else zero-filled (nothing read)
    cp_async4(smem_addr(&s.delta[buf][tid]), has_delta ? g.delta + n0 + tid : g.inv, has_delta);
    if (with_inv) cp_async4(smem_addr(&s.inv[buf][tid]), g.inv + (ok ? n0 + tid : 0), ok);
  }
  cp_async_commit();
}

// dn = do · inv (bf16) and dd = -delta · inv for the chunk in `buf`; inv is s.inv[buf] (1 without normalising).
template <int DVT>
__device__ __forceinline__ void scale_dout(BwdSmem<DVT>& s, int buf, bool normalize) {
  for (int i = threadIdx.x; i < CHUNK * DVT; i += THREADS) {
    const int r = i / DVT, col = i % DVT;
    const float inv = normalize ? s.inv[buf][r] : 1.f;
    s.dn(r, col) = __float2bfloat16_rn(__bfloat162float(s.dout[buf](r, col)) * inv);
  }
  if (threadIdx.x < CHUNK) s.dd[threadIdx.x] = normalize ? -s.delta[buf][threadIdx.x] * s.inv[buf][threadIdx.x] : 0.f;
}

// The Jacobian of feature tile f (< 16: features (f, b); 16: the linear ones) applied to u, the tile's 16 x 16 block
// of (rows x features): x holds the rows' 16 inputs (fp32, u's layout), xf the rows' input f (this lane's two rows).
//   f < 16: d[·, b] += quad · x[·, f] u[·, b] and d[·, f] += quad · Σ_b u[·, b] x[·, b];  f = 16: d += lin · u.
__device__ __forceinline__ void feature_jacobian(rt_fl<BASE, BASE>& d, const rt_fl<BASE, BASE>& u,
                                                 const rt_fl<BASE, BASE>& x, const float (&xf)[2], int f, float quad,
                                                 float lin) {
  auto& dt = d.tiles[0][0].data;
  const auto& ut = u.tiles[0][0].data;
  const auto& xt = x.tiles[0][0].data;
  if (f == DK) {
#pragma unroll
    for (int k = 0; k < 4; ++k) dt[k].x += lin * ut[k].x, dt[k].y += lin * ut[k].y;
    return;
  }
  float dot[2] = {0.f, 0.f};  // register k holds row half k & 1
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    dt[k].x += quad * xf[k & 1] * ut[k].x;
    dt[k].y += quad * xf[k & 1] * ut[k].y;
    dot[k & 1] += ut[k].x * xt[k].x + ut[k].y * xt[k].y;
  }
  // column f sits in lane quad (f % 8) / 2, register half f / 8, pair slot f % 2
  const bool mine = (laneid() & 3) == ((f & 7) >> 1);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(dot[h]);
    if (mine) {  // static register indices (f is a run-time loop index): no local-memory array
      const float add = quad * sum;
      if (f & 8) {
        if (f & 1) dt[h + 2].y += add; else dt[h + 2].x += add;
      } else {
        if (f & 1) dt[h].y += add; else dt[h].x += add;
      }
    }
  }
}

// Adds this warp's 16 x 16 fp32 partial to rows row0.. of a (N, 16) fp32 buffer.
__device__ __forceinline__ void atomic_add_rows(float* dst, const rt_fl<BASE, BASE>& part, int row0, int N) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int r = row0 + base_row<row_layout>(k, 0), col = base_col<row_layout>(k, 0);
    if (r >= N) continue;
    atomicAdd(dst + int64_t(r) * DK + col, part.tiles[0][0].data[k].x);
    atomicAdd(dst + int64_t(r) * DK + col + 1, part.tiles[0][0].data[k].y);
  }
}

// The gradient of this warp's 16 rows of one side (q in kernel A, k in kernel B) from its half of the columns:
//   intra-chunk: G = rows_v · all_vᵀ (+ intra_dd), W = G ∘ scale (1 + s) on the causal side, d = W · other;
//   inter-chunk: per feature tile f ≤ 16, u = rows_v · state_fᵀ (+ inter_dd), through the side's map's Jacobian.
// Kernel A: rows_v = dn, all_v = v, other = k, state = H; kernel B: rows_v = v, all_v = dn, other = q, state = R.
// UPPER: the causal side is on and above the diagonal (key rows against later queries, kernel B).
template <bool UPPER, int DVT, class IntraDd, class InterDd>
__device__ __forceinline__ void side_gradient(rt_fl<BASE, DK>& d, const BwdSmem<DVT>& s, const QKTile& side,
                                              const QKTile& other, const rt_bf<BASE, DVT / 2>& rows_v,
                                              const rt_bf<CHUNK, DVT / 2>& all_v, const rt_fl<BASE, CHUNK>& sc,
                                              int grp, int cols, float scale, float quad, float lin,
                                              IntraDd&& intra_dd, InterDd&& inter_dd) {
  const int r0 = BASE * grp + (laneid() >> 2);  // this lane's rows: r0 and r0 + 8
  rt_fl<BASE, CHUNK> gw;
  zero(gw);
  mma_ABt(gw, rows_v, all_v, gw);
  map_indexed(gw, gw, sc, [&](int r, int col, float gv, float dot) {
    const bool causal = UPPER ? col >= BASE * grp + r : col <= BASE * grp + r;
    return causal ? (gv + intra_dd(r, col)) * scale * (1.f + scale * dot) : 0.f;
  });
  rt_bf<BASE, CHUNK> w;
  copy(w, gw);
  rt_bf<CHUNK, DK, col_layout> oc;
  load(oc, other);
  zero(d);
  mma_AB(d, w, oc, d);

  rt_bf<BASE, DK> xr;
  load(xr, side, BASE * grp, 0);
  rt_fl<BASE, DK> x;
  copy(x, xr);
#pragma unroll 1
  for (int f = 0; f <= DK; ++f) {
    rt_bf<BASE, DVT / 2> sf;
    load(sf, s.state, BASE * f, cols);
    rt_fl<BASE, BASE> u;
    zero(u);
    mma_ABt(u, rows_v, sf, u);
    map_indexed(u, u, [&](int r, int b, float uv) { return uv + inter_dd(r, f, b); });
    float xf[2] = {0.f, 0.f};
    if (f < DK) xf[0] = __bfloat162float(side(r0, f)), xf[1] = __bfloat162float(side(r0 + 8, f));
    feature_jacobian(d, u, x, xf, f, quad, lin);
  }
}

// Kernel B, one chunk: dv and dk for this warp's 16 key rows and half of the block's columns.
template <int DVT>
__device__ __forceinline__ void dkdv_chunk(BwdSmem<DVT>& s, int buf, int c, const BasedBwdArgs& a, int vt, bf16* dv,
                                           float* dk) {
  const int warp = warpid(), lane = laneid(), grp = warp >> 1, cols = (DVT / 2) * (warp & 1);
  const float scale = a.scale;
  const int r0 = BASE * grp + (lane >> 2);  // this lane's key rows: r0 and r0 + 8
  rt_bf<BASE, DK> kr;
  load(kr, s.k[buf], BASE * grp, 0);
  rt_bf<CHUNK, DK> qr;
  load(qr, s.q[buf]);
  rt_fl<BASE, CHUNK> sc;  // k_j · q_i: key rows, query columns
  zero(sc);
  mma_ABt(sc, kr, qr, sc);

  // dv, intra-chunk: κᵀ on and above the diagonal (query i ≥ key j), times dn
  rt_bf<BASE, CHUNK> kappa;
  map_indexed(kappa, sc, [&](int r, int col, float kq) {
    const float x = scale * kq;
    return col >= BASE * grp + r ? 1.f + x + 0.5f * x * x : 0.f;
  });
  rt_bf<CHUNK, DVT / 2, col_layout> dnc;
  load(dnc, s.dn, 0, cols);
  rt_fl<BASE, DVT / 2> dvp;
  zero(dvp);
  mma_AB(dvp, kappa, dnc, dvp);
  // dv, inter-chunk: φk(k) · R, one feature tile at a time (the forward's inter-chunk product, q and k swapped)
#pragma unroll 2
  for (int f = 0; f < TILES; ++f) {
    float ka[2] = {0.f, 0.f};
    if (f < DK) ka[0] = __bfloat162float(s.k[buf](r0, f)), ka[1] = __bfloat162float(s.k[buf](r0 + 8, f));
    rt_bf<BASE, BASE> p;
    map_indexed(p, kr, [&](int r, int b, float kb) {
      return f < DK ? ka[r >> 3] * kb : f == DK ? kb : (b == 0 ? 1.f : 0.f);
    });
    rt_bf<BASE, DVT / 2, col_layout> rf;
    load(rf, s.state, BASE * f, cols);
    mma_AB(dvp, p, rf, dvp);
  }
  store_rows(dv, a.dv, dvp, c * CHUNK + BASE * grp, a.N, cols, {1.f, 1.f});

  // dk: the same as kernel A's dq with the sides swapped; dd belongs to the query columns, and r holds R's
  const bool with_dd = a.normalize && vt == 0 && (warp & 1) == 0;  // the dd terms once per row
  rt_bf<BASE, DVT / 2> vr;
  load(vr, s.v[buf], BASE * grp, cols);
  rt_bf<CHUNK, DVT / 2> dnr;
  load(dnr, s.dn, 0, cols);
  rt_fl<BASE, DK> dkp;
  side_gradient<true>(
      dkp, s, s.k[buf], s.q[buf], vr, dnr, sc, grp, cols, scale, 1.f, 1.f,
      [&](int, int col) { return with_dd ? s.dd[col] : 0.f; },
      [&](int, int f, int b) { return with_dd ? s.z[BASE * f + b] : 0.f; });
  atomic_add_rows(dk, dkp, c * CHUNK + BASE * grp, a.N);
}

template <int DVT>
__device__ __forceinline__ BwdRows bwd_rows(const BasedBwdArgs& a, int bh, int vt) {
  const int b = bh / a.H, h = bh % a.H;
  BwdRows g;
  g.in.q = static_cast<const bf16*>(a.q) + b * a.q_stride[0] + h * a.q_stride[1];
  g.in.k = static_cast<const bf16*>(a.k) + b * a.k_stride[0] + h * a.k_stride[1];
  g.in.v = static_cast<const bf16*>(a.v) + b * a.v_stride[0] + h * a.v_stride[1] + vt * DVT;
  g.in.qn = a.q_stride[2], g.in.kn = a.k_stride[2], g.in.vn = a.v_stride[2];
  g.in.N = a.N;
  g.dout = static_cast<const bf16*>(a.dout) + int64_t(bh) * a.N * a.dv + vt * DVT;
  g.delta = a.delta ? a.delta + int64_t(bh) * a.N : nullptr;
  g.inv = a.inv + int64_t(bh) * a.N;
  g.dv = a.dv;
  return g;
}

template <int DVT>
__device__ __forceinline__ void clear_state(BwdSmem<DVT>& s) {
  for (int i = threadIdx.x; i < StateTile<DVT>::bytes / 16; i += THREADS)
    reinterpret_cast<uint4*>(s.state.data)[i] = make_uint4(0, 0, 0, 0);
  for (int i = threadIdx.x; i < FEATURES; i += THREADS) s.z[i] = 0.f;
}

template <int DVT>
__global__ void __launch_bounds__(THREADS, 1) based_bwd_dkdv_kernel(const BasedBwdArgs a) {
  extern __shared__ uint8_t raw[];
  BwdSmem<DVT>& s = *reinterpret_cast<BwdSmem<DVT>*>(align_shared<1024>(raw));
  const int tiles_v = a.dv / DVT, bh = blockIdx.x / tiles_v, vt = blockIdx.x % tiles_v;
  const BwdRows g = bwd_rows<DVT>(a, bh, vt);
  bf16* dv = static_cast<bf16*>(a.dv_out) + int64_t(bh) * a.N * a.dv + vt * DVT;
  float* dk = a.dk + int64_t(bh) * a.N * DK;
  const bool with_dd = a.normalize && vt == 0;
  const int chunks = (a.N + CHUNK - 1) / CHUNK;
  load_bwd_chunk(s, (chunks - 1) & 1, g, chunks - 1, a.normalize);
  clear_state(s);
  rt_fl<BASE, DVT> acc[OWNED];
#pragma unroll
  for (int i = 0; i < OWNED; ++i) zero(acc[i]);
  for (int c = chunks - 1; c >= 0; --c) {
    const int buf = c & 1;
    cp_async_wait<0>();
    __syncthreads();  // chunk c and the state of the chunks after it are visible; chunk c + 1's buffer is free
    if (c > 0) load_bwd_chunk(s, buf ^ 1, g, c - 1, a.normalize);
    scale_dout(s, buf, a.normalize);
    __syncthreads();
    dkdv_chunk(s, buf, c, a, vt, dv, dk);
    if (c == 0) break;
    __syncthreads();  // every warp has read the state before its owners change it
    // R += φq(q)ᵀ dn and r += Σ dd φq(q)
    state_update<DVT>(s, s.q[buf], s.dn, 0.5f * a.scale * a.scale, a.scale, with_dd,
                          [&](int t) { return s.dd[t]; }, acc);
  }
}

template <int DVT, class Kernel>
const char* launch_bwd(Kernel kernel, const BasedBwdArgs& a, cudaStream_t stream) {
  const int64_t blocks = int64_t(a.B) * a.H * (a.dv / DVT);
  if (blocks > 0x7fffffff) return "too many (batch, head, value tile) blocks for one launch";
  const size_t smem = sizeof(BwdSmem<DVT>) + 1024;
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (attr != cudaSuccess) return cudaGetErrorString(attr);
  kernel<<<unsigned(blocks), THREADS, smem, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}


// delta = do·o per row of (B·H·N, dv) contiguous bf16 rows: one warp a row (one kernel instead of ATen's four passes
// through fp32 copies).
__global__ void __launch_bounds__(256) based_bwd_delta_kernel(const BasedBwdArgs a, int64_t rows) {
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

}  // namespace

const char* launch_based_backward(const BasedBwdArgs& a, cudaStream_t stream) {
  if (a.dv <= 0 || a.dv % BASED_DV_TILE != 0) return "dv must be a positive multiple of 64";
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  // 32 value columns per block (twice the blocks) where the forward takes them, when the doubled grid still fits in
  // one wave. Measured on the H200 (RESULTS.md), fwd+bwd: B4 H16 N4096 2.14 ms vs 2.36; at B16 (256 blocks) 7.9 ms
  // vs 5.4.
  const long long blocks = (long long)a.B * a.H * (a.dv / BASED_DV_TILE);
  const bool narrow = tk::grid::waves_of(2 * blocks, 1) == 1;
  if (a.normalize) {
    const int64_t rows = int64_t(a.B) * a.H * a.N, delta_blocks = (rows + 7) / 8;
    if (delta_blocks > 0x7fffffff) return "too many rows for the delta launch";
    based_bwd_delta_kernel<<<unsigned(delta_blocks), 256, 0, stream>>>(a, rows);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  }
  // dq first: it also writes 1/(d + eps), which the reverse scan reads
  if (const char* err = launch_based_dq(a, stream)) return err;
  return narrow ? launch_bwd<32>(based_bwd_dkdv_kernel<32>, a, stream) : launch_bwd<64>(based_bwd_dkdv_kernel<64>, a, stream);
}

}  // namespace tk_linear_attention
