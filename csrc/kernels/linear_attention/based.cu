// Based linear attention, forward (linear_attention.h): a chunked causal scan with an fp32 state in registers.
//
// One block per (batch·head, tile of 64 value columns; 32 for small grids) walks the sequence in chunks of 64 tokens:
//   o_chunk = [(1 + s + s²/2) ⊙ causal] v_chunk + φq(q_chunk) · S     (s = scale·q kᵀ inside the chunk)
//   S      += φk(k_chunk)ᵀ v_chunk                                      (then the next chunk)
// φ, of 288 features in 18 tiles of 16, is built in registers from the 16-wide q and k rows (based.cuh).
//
// Warps: 8. For the outputs, warp w owns chunk rows 16·(w/2).. and half the block's value columns; for the state,
// warp w owns tiles w, w + 8 and w + 16 (if < 18) as fp32 register tiles (16 x the block's columns), adds each
// chunk's keys to them, and publishes a bf16 copy in shared memory that every warp reads for the next chunk's
// inter-chunk product. The normaliser is the same scan with a value of ones; its state z (288 floats) is in shared memory.
// Loads are cp.async, double-buffered: chunk c + 1 lands while chunk c is computed.
#include "based.cuh"

namespace tk_linear_attention {
namespace {

// DVT: value columns per block (64, or 32 for twice the blocks when batch·heads leave SMs idle).
template <int DVT>
struct Smem {
  QKTile q[2], k[2];
  VTile<DVT> v[2];
  StateTile<DVT> state;  // bf16 copy of the state after the previous chunk
  float z[FEATURES];     // normaliser state: Σ φk over the previous chunks
};

// Chunk c into buffer `buf`: q and k rows are two 16-byte segments (threads 0-127: q, 128-255: k), v rows
// DVT / 8; rows past N are zero-filled.
template <int DVT>
__device__ __forceinline__ void load_chunk(Smem<DVT>& s, int buf, const Rows& g, int c) {
  const int tid = threadIdx.x, n0 = c * CHUNK;
  {
    const bool is_q = tid < 128;
    const int t = tid & 127, r = t >> 1, seg = t & 1, n = n0 + r;
    const bool ok = n < g.N;
    const bf16* src = (is_q ? g.q : g.k) + (ok ? int64_t(n) * (is_q ? g.qn : g.kn) + seg * 8 : 0);
    const QKTile& dst = is_q ? s.q[buf] : s.k[buf];
    cp_async16(smem_addr(dst.data) + QKTile::offset(r, seg * 8), src, ok);
  }
#pragma unroll
  for (int i = 0; i < CHUNK * DVT / 8 / THREADS; ++i) {
    const int t = tid + i * THREADS, r = t / (DVT / 8), seg = t % (DVT / 8), n = n0 + r;
    const bool ok = n < g.N;
    cp_async16(smem_addr(s.v[buf].data) + VTile<DVT>::offset(r, seg * 8), g.v + (ok ? int64_t(n) * g.vn + seg * 8 : 0), ok);
  }
  cp_async_commit();
}

// Phase 1: this warp's 16 rows x DVT/2 columns of the chunk's output, from the chunk itself and the state.
template <int DVT>
__device__ __forceinline__ void chunk_output(const Smem<DVT>& s, int buf, int c, const BasedArgs& a, bf16* o) {
  constexpr int HALF = DVT / 2;
  const int warp = warpid(), lane = laneid(), grp = warp >> 1, cols = HALF * (warp & 1);
  const float scale = a.scale, half_sq = 0.5f * scale * scale;
  rt_bf<BASE, DK> qr;
  load(qr, s.q[buf], BASE * grp, 0);
  rt_bf<CHUNK, DK> kr;
  load(kr, s.k[buf]);
  rt_fl<BASE, CHUNK> sc;
  zero(sc);
  mma_ABt(sc, qr, kr, sc);

  // intra-chunk weights 1 + x + x²/2 (x = scale·q·k) on and below the diagonal
  rt_bf<BASE, CHUNK> w;
  float zrow[2] = {0.f, 0.f};  // the normaliser's partial row sums (this lane's rows r0 and r0 + 8)
  map_indexed(w, sc, [&](int r, int col, float qk) {
    const float x = scale * qk, val = col <= BASE * grp + r ? 1.f + x + 0.5f * x * x : 0.f;
    zrow[r >> 3] += val;
    return val;
  });
  rt_bf<CHUNK, HALF, col_layout> vr;
  load(vr, s.v[buf], 0, cols);
  rt_fl<BASE, HALF> out;
  zero(out);
  mma_AB(out, w, vr, out);

  // inter-chunk: φq(q) · state, one feature tile at a time
  const int r0 = BASE * grp + (lane >> 2);  // this lane's chunk rows: r0 and r0 + 8
  float zq[2] = {0.f, 0.f};
#pragma unroll 2
  for (int f = 0; f < TILES; ++f) {
    float qa[2] = {0.f, 0.f};
    if (f < DK) {
      qa[0] = half_sq * __bfloat162float(s.q[buf](r0, f));
      qa[1] = half_sq * __bfloat162float(s.q[buf](r0 + 8, f));
    }
    rt_bf<BASE, BASE> p;  // φq(q) for feature tile f: rows are this warp's tokens, columns b
    map_indexed(p, qr, [&](int r, int b, float qb) {
      const float val = f < DK ? qa[r >> 3] * qb : f == DK ? scale * qb : (b == 0 ? 1.f : 0.f);
      if (a.normalize) zq[r >> 3] += val * s.z[BASE * f + b];
      return val;
    });
    rt_bf<BASE, HALF, col_layout> sv;
    load(sv, s.state, BASE * f, cols);
    mma_AB(out, p, sv, out);
  }

  float inv[2] = {1.f, 1.f};
  if (a.normalize)
#pragma unroll
    for (int i = 0; i < 2; ++i) inv[i] = 1.f / (quad_sum(zrow[i] + zq[i]) + a.eps);
  store_rows(o, a.dv, out, c * CHUNK + BASE * grp, a.N, cols, inv);
}

template <int DVT>
__global__ void __launch_bounds__(THREADS, 1) based_fwd_kernel(const BasedArgs a) {
  extern __shared__ uint8_t raw[];
  Smem<DVT>& s = *reinterpret_cast<Smem<DVT>*>(align_shared<1024>(raw));
  const int tiles_v = a.dv / DVT;
  const int bh = blockIdx.x / tiles_v, vt = blockIdx.x % tiles_v;
  const int b = bh / a.H, h = bh % a.H;
  Rows g;
  g.q = static_cast<const bf16*>(a.q) + b * a.q_stride[0] + h * a.q_stride[1];
  g.k = static_cast<const bf16*>(a.k) + b * a.k_stride[0] + h * a.k_stride[1];
  g.v = static_cast<const bf16*>(a.v) + b * a.v_stride[0] + h * a.v_stride[1] + vt * DVT;
  g.qn = a.q_stride[2], g.kn = a.k_stride[2], g.vn = a.v_stride[2];
  g.N = a.N;
  bf16* o = static_cast<bf16*>(a.o) + int64_t(bh) * a.N * a.dv + vt * DVT;

  const int chunks = (a.N + CHUNK - 1) / CHUNK;
  load_chunk(s, 0, g, 0);
  for (int i = threadIdx.x; i < StateTile<DVT>::bytes / 16; i += THREADS)
    reinterpret_cast<uint4*>(s.state.data)[i] = make_uint4(0, 0, 0, 0);
  for (int i = threadIdx.x; i < FEATURES; i += THREADS) s.z[i] = 0.f;
  rt_fl<BASE, DVT> acc[OWNED];
#pragma unroll
  for (int i = 0; i < OWNED; ++i) zero(acc[i]);

  for (int c = 0; c < chunks; ++c) {
    const int buf = c & 1;
    cp_async_wait<0>();
    __syncthreads();  // chunk c and the state after chunk c - 1 are visible; chunk c - 1's buffer is free
    if (c + 1 < chunks) load_chunk(s, buf ^ 1, g, c + 1);
    chunk_output(s, buf, c, a, o);
    if (c + 1 == chunks) break;  // the last chunk's state is never read
    __syncthreads();  // every warp has read the state before its owners change it
    chunk_state<DVT>(s, buf, acc);
  }
}

template <int DVT>
const char* launch_tile(const BasedArgs& a, cudaStream_t stream) {
  const int64_t blocks = int64_t(a.B) * a.H * (a.dv / DVT);
  if (blocks > 0x7fffffff) return "too many (batch, head, value tile) blocks for one launch";
  const size_t smem = sizeof(Smem<DVT>) + 1024;  // + the alignment of the dynamic shared memory base
  // per call: the attribute belongs to the current device's context
  const cudaError_t attr = cudaFuncSetAttribute(based_fwd_kernel<DVT>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (attr != cudaSuccess) return cudaGetErrorString(attr);
  based_fwd_kernel<DVT><<<unsigned(blocks), THREADS, smem, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Measured on the H200 (benchmarks/RESULTS.md): a block of 32 columns takes ~0.77 of the time of one of 64
// (the feature maps are built in both), so the split pays only when the doubled grid still fits in one wave
// (B4 H16 dv64, 64 blocks: 0.33 ms vs 0.42); at 256 blocks it is 1.5x slower.
bool narrow_tiles(const BasedArgs& a) {
  const long long blocks = (long long)a.B * a.H * (a.dv / BASED_DV_TILE);
  return tk::grid::waves_of(2 * blocks, 1) == 1;
}

}  // namespace

const char* launch_based(const BasedArgs& a, cudaStream_t stream) {
  if (a.dv <= 0 || a.dv % BASED_DV_TILE != 0) return "dv must be a positive multiple of 64";
  if (a.B <= 0 || a.H <= 0 || a.N <= 0) return nullptr;  // nothing to compute
  return narrow_tiles(a) ? launch_tile<32>(a, stream) : launch_tile<64>(a, stream);
}

}  // namespace tk_linear_attention
