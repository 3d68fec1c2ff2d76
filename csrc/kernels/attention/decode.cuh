// Attention for short queries (decode steps: at most kDecodeRows query rows against a long KV cache), split over the
// keys (flash-decoding). The forward kernels give each CTA a 64..192-row query tile, so a step's one or few rows per
// head would leave the tensor cores and most SMs idle and read the cache with a handful of CTAs; here the rows of a
// GQA group (its G query heads x N rows share one K/V head) form one tile, and the keys are split across CTAs until
// the grid fills the GPU. Reading the cache is the cost, so the kernel is a cp.async stream of K/V blocks through a
// STAGES-deep shared ring, with warp-level mma.sync for the small products (tk register tiles).
//
// A CTA = (row group of up to 64 rows, key split, batch x kv head); 4 warps. Warp w owns row tile w % RT (16 rows)
// and key slice w / RT (16·RT keys) of each 64-key block, keeping its own online softmax (exp2 domain, fp32). At
// the end the warps of a row tile merge through shared memory. One split writes o and lse directly; several write
// normalised fp32 partials and their lse, and decode_combine_kernel merges them per row.
#pragma once
#include <climits>
#include <cmath>
#include <type_traits>

#include "common.cuh"
#include "decode.h"
#include "tk/ops/thread/cp_async.cuh"
#include "tk/ops/warp/mma.cuh"
#include "tk/tk.cuh"
#include "tk/grid.cuh"

namespace tk_attn {
namespace decode {

template <typename T, int DK, int RT>
struct Smem {
  tk::st<T, 16 * RT, DK> q;
  tk::st<T, BK, DK> k[STAGES], v[STAGES];
};

}  // namespace decode

namespace {
using namespace decode;

// The keys query position n of batch entry b sees: [x, y] (empty when x > y).
__device__ __forceinline__ int2 row_interval(const Params& p, int b, int n) {
  int x = 0, y = int(p.k.S) - 1;
  if (p.sc.causal) {
    y = min(y, n);
    if (p.sc.window > 0) x = max(x, n - p.sc.window + 1);
  }
  const int2 t = interval(p.sc.row_keys, b, int(p.q.S), n, make_int2(x, y));
  return make_int2(max(x, t.x), min(y, t.y));
}

// Issue the cp.async copies of the ROWS rows of `dst`: 16-byte chunks of row r from the element offset row(r) of
// `src` (< 0: zero-filled), zero-filled past the head dim.
template <int ROWS, typename ST, class Row>
__device__ __forceinline__ void load_rows(ST& dst, const View4& src, Row&& row) {
  constexpr int CHUNKS = ST::cols / 8, TOTAL = ROWS * CHUNKS;
  const char* base = static_cast<const char*>(src.ptr);
  const int c = int(threadIdx.x) % CHUNKS;
  const bool col_ok = 8 * c < src.D;
#pragma unroll
  for (int i = int(threadIdx.x); i < TOTAL; i += THREADS) {
    const int r = i / CHUNKS;
    const int64_t at = row(r);
    const bool ok = col_ok && at >= 0;
    tk::cp_async16(tk::smem_addr(&dst(r, 8 * c)), ok ? base + 2 * (at + 8 * c) : src.ptr, ok);
  }
}

template <typename T, int DK, int RT>
__global__ void __launch_bounds__(THREADS) decode_kernel(const Params p) {
  constexpr int KW = BK * RT / WARPS;  // keys of a block per warp
  constexpr int PIECES = KW / 16;
  constexpr int ROWS = 16 * RT;
  // The head dim in register chunks of DC columns: the whole row up to D = 128 (q stays in registers across blocks);
  // at D = 256 o alone takes 128 registers a lane, so q, K and V pass through registers 64 columns at a time (q
  // re-read from shared memory each block).
  constexpr int DC = DK > 128 ? 64 : DK, NCH = DK / DC;
  extern __shared__ char raw[];
  Smem<T, DK, RT>& sm = *reinterpret_cast<Smem<T, DK, RT>*>(tk::align_shared<1024>(raw));
  __shared__ int2 span;

  const int rg = blockIdx.x, split = blockIdx.y, bh = blockIdx.z;
  const int Hkv = int(p.k.H), b = bh / Hkv, hkv = bh % Hkv;
  const int warp = tk::warpid(), lane = tk::laneid(), rt = warp % RT, slice = warp / RT;
  const Rows rw = p.rows;
  const int row_base = GROUP_ROWS * rg;

  tk::grid::wait_prior_grid();
  // Q rows: row r of the tile is query (head hkv·G + g, position n), r_global = g·N + n; zero past R.
  load_rows<ROWS>(sm.q, p.q, [&](int r) -> int64_t {
    const int rr = row_base + r, g = rr / rw.N, n = rr - g * rw.N;
    return rr < rw.R ? b * p.q.sb + (int64_t(hkv) * rw.G + g) * p.q.sh + n * p.q.ss : -1;
  });
  // The union of the tile's rows' key intervals bounds the blocks this CTA reads.
  if (warp == 0) {
    int lo = INT_MAX, hi = -1;
    for (int r = lane; r < ROWS; r += 32) {
      const int rr = row_base + r;
      if (rr < rw.R) {
        const int2 iv = row_interval(p, b, rr % rw.N);
        if (iv.x <= iv.y) lo = min(lo, iv.x), hi = max(hi, iv.y);
      }
    }
    lo = __reduce_min_sync(0xffffffffu, lo), hi = __reduce_max_sync(0xffffffffu, hi);
    if (lane == 0) span = make_int2(lo, hi);
  }
  __syncthreads();
  const int first = split * p.blocks_per_split;
  const int blk0 = max(first, span.x / BK);
  const int blk1 = span.y < 0 ? blk0 : min(first + p.blocks_per_split, span.y / BK + 1);
  const int nb = max(0, blk1 - blk0);

  // This lane's two rows (lane/4 and lane/4 + 8 of its row tile): their key intervals.
  int2 iv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = row_base + 16 * rt + tk::pair8_pos(h);
    iv[h] = rr < rw.R ? row_interval(p, b, rr % rw.N) : make_int2(1, 0);
  }

  const int64_t kplane = b * p.k.sb + hkv * p.k.sh, vplane = b * p.v.sb + hkv * p.v.sh;
  const int M = int(p.k.S);
  auto load_stage = [&](int stage, int blk) {
    const int row0 = blk * BK;  // rows past M read as zero
    load_rows<BK>(sm.k[stage], p.k, [&](int r) -> int64_t { return row0 + r < M ? kplane + (row0 + r) * p.k.ss : -1; });
    load_rows<BK>(sm.v[stage], p.v, [&](int r) -> int64_t { return row0 + r < M ? vplane + (row0 + r) * p.v.ss : -1; });
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < nb) load_stage(i, blk0 + i);
    tk::cp_async_commit();  // the first group also carries Q
  }

  const float cap = p.sc.softcap, scale = p.sc.scale;
  // The base of a row's exponentials: its running max, 0 while the row has seen no key (max -inf: P = 0, alpha = 0).
  using Vec = tk::row_vec<tk::rt_fl<16, 16>>;
  auto base_of = [](Vec& base, const Vec& mx) {
    tk::vec_for_each(base, [&](int t, int k) { return mx.data[t][k] == -INFINITY ? 0.f : mx.data[t][k]; });
  };
  tk::rt<T, 16, DC> q;
  tk::rt_fl<16, DC> o[NCH];
  Vec m, l;
#pragma unroll
  for (int ch = 0; ch < NCH; ++ch) tk::zero(o[ch]);
  tk::neg_infty(m);
  tk::zero(l);

  for (int i = 0; i < nb; ++i) {
    tk::cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (i + STAGES - 1 < nb) load_stage((i + STAGES - 1) % STAGES, blk0 + i + STAGES - 1);
    tk::cp_async_commit();
    if (NCH == 1 && i == 0) tk::load(q, sm.q, 16 * rt, 0);
    const int stage = i % STAGES, key0 = (blk0 + i) * BK + slice * KW;

    tk::rt_fl<16, 16> s[PIECES];
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {
      tk::zero(s[j]);
#pragma unroll
      for (int ch = 0; ch < NCH; ++ch) {
        if constexpr (NCH > 1) tk::load(q, sm.q, 16 * rt, DC * ch);
        tk::rt<T, 16, DC> kj;
        tk::load(kj, sm.k[stage], slice * KW + 16 * j, DC * ch);
        tk::mma_ABt(s[j], q, kj, s[j]);
      }
      // scores in the log2 domain; keys outside the row's interval (and past M) hidden
      tk::map_indexed(s[j], s[j], [&](int r, int c, float x) {
        const int key = key0 + 16 * j + c;
        const int2 w = iv[r >> 3];
        const float t = cap > 0.f ? cap * tanhf(x * scale / cap) : x * scale;
        return key >= w.x && key <= w.y ? t * LOG2E : -INFINITY;
      });
    }
    Vec mn, base, alpha, sum;
    mn = m;
#pragma unroll
    for (int j = 0; j < PIECES; ++j) tk::row_max(mn, s[j], mn);
    base_of(base, mn);
    tk::sub(alpha, m, base);
    tk::exp2(alpha, alpha);
    tk::mul(l, l, alpha);
#pragma unroll
    for (int ch = 0; ch < NCH; ++ch) tk::mul_row(o[ch], o[ch], alpha);
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {
      tk::sub_row(s[j], s[j], base);
      tk::exp2(s[j], s[j]);
      tk::row_sum(sum, s[j]);
      tk::add(l, l, sum);
      tk::rt<T, 16, 16> pj;
      tk::copy(pj, s[j]);
#pragma unroll
      for (int ch = 0; ch < NCH; ++ch) {
        tk::rt<T, 16, DC, tk::col_layout> vj;
        tk::load(vj, sm.v[stage], slice * KW + 16 * j, DC * ch);
        tk::mma_AB(o[ch], pj, vj, o[ch]);
      }
    }
    m = mn;
  }
  tk::cp_async_wait<0>();
  __syncthreads();  // the ring is free: it becomes the merge area

  // Merge the key slices of each row tile: every warp parks (m, l, o) in its lanes' order; the first slice's warp
  // folds in the others.
  constexpr int OREG = DK / 16 * 8, CREG = DC / 16 * 8;  // fp32 values of o per lane, of a chunk of o
  float* park = reinterpret_cast<float*>(&sm.k[0]);
  auto slot = [&](int w, int x) -> float& { return park[(w * (OREG + 4) + x) * 32 + lane]; };
  auto o_at = [&](tk::rt_fl<16, DC> (&t)[NCH], int x) -> float& {
    float2& pr = t[x / CREG].tiles[0][x % CREG / 8].data[(x / 2) % 4];
    return x % 2 ? pr.y : pr.x;
  };
  if (WARPS / RT > 1) {
    if (slice > 0) {
#pragma unroll
      for (int x = 0; x < OREG; ++x) slot(warp, x) = o_at(o, x);
      slot(warp, OREG) = m.data[0][0], slot(warp, OREG + 1) = m.data[0][1];
      slot(warp, OREG + 2) = l.data[0][0], slot(warp, OREG + 3) = l.data[0][1];
    }
    __syncthreads();
    if (slice > 0) return;
#pragma unroll
    for (int other = rt + RT; other < WARPS; other += RT) {
      Vec mo, lo, mn, base, a, c;
      mo.data[0][0] = slot(other, OREG), mo.data[0][1] = slot(other, OREG + 1);
      lo.data[0][0] = slot(other, OREG + 2), lo.data[0][1] = slot(other, OREG + 3);
      tk::max(mn, m, mo);
      base_of(base, mn);
      tk::sub(a, m, base), tk::exp2(a, a);
      tk::sub(c, mo, base), tk::exp2(c, c);
#pragma unroll
      for (int x = 0; x < OREG; ++x) {
        const int h = (x / 2) % 2;  // register k = (x/2)%4: its row half is k % 2
        o_at(o, x) = o_at(o, x) * a.data[0][h] + slot(other, x) * c.data[0][h];
      }
      tk::mul(l, l, a);
      tk::mul(lo, lo, c);
      tk::add(l, l, lo);
      m = mn;
    }
  }

  // Normalise; a row without keys gives o = 0 and lse = +inf (one split) or a partial of weight 0 (lse = -inf).
  const bool split_out = p.splits > 1;
  float inv[2], lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float lv = l.data[0][h], mv = m.data[0][h];
    inv[h] = lv > 0.f ? 1.f / lv : 0.f;
    lse[h] = lv > 0.f ? (mv + log2f(lv)) * LN2 : (split_out ? -INFINITY : INFINITY);
  }
  const int D = int(p.q.D), Hq = int(p.q.H);
  // Row half h of this lane's o, normalised, into the row at dst (fp32 partials or the output's dtype).
  auto store_row = [&](auto* dst, int h) {
    using U = std::remove_pointer_t<decltype(dst)>;
#pragma unroll
    for (int w = 0; w < DK / 16; ++w)
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const int col = 16 * w + tk::quad_pos(2 * kk);
        const float2 v = o[w / (DC / 16)].tiles[0][w % (DC / 16)].data[2 * kk + h];
        if (col < D)
          *reinterpret_cast<tk::packed_t<U>*>(dst + col) =
              tk::make_packed<U>(tk::convert<U>(v.x * inv[h]), tk::convert<U>(v.y * inv[h]));
      }
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rl = 16 * rt + tk::pair8_pos(h), rr = row_base + rl;
    if (rr >= rw.R) continue;
    const int g = rr / rw.N, n = rr - g * rw.N, hq = hkv * rw.G + g;
    if (split_out) {
      const int64_t prow = ((int64_t(bh) * p.groups + rg) * p.splits + split) * ROWS + rl;
      store_row(p.part_o + prow * D, h);
      if ((lane & 3) == 0) p.part_lse[prow] = lse[h];
    } else {
      store_row(static_cast<T*>(p.o) + ((int64_t(b) * rw.N + n) * Hq + hq) * D, h);
      if ((lane & 3) == 0) p.lse[(int64_t(b) * Hq + hq) * rw.N + n] = lse[h];
    }
  }
}

// One CTA per query row: the weighted sum of its splits' partials, weights exp(lse_s - max). The threads take the
// splits in turn for the max and the weights (kept in shared memory); then warp w sums splits w, w + WARPS, ...,
// each lane 4 columns, several splits' loads in flight, and the warps' sums are added in shared memory. At batch 1
// the merge is latency-bound: one warp per row walking its splits one after the other took 6-9 us on the H200
// (32 rows, 16-32 splits).
template <typename T>
__global__ void __launch_bounds__(THREADS) decode_combine_kernel(const Params p, int row_tile) {
  constexpr int PASSES = 2;  // 128 columns a pass, 4 a lane: head dims up to 256
  __shared__ float weight[MAX_SPLITS];
  __shared__ float4 sums[WARPS][PASSES][32];
  __shared__ float reduce[WARPS];
  tk::grid::wait_prior_grid();
  const int64_t row = blockIdx.x;
  const int Hq = int(p.q.H), N = p.rows.N, D = int(p.q.D), lane = tk::laneid(), warp = tk::warpid();
  const int n = int(row % N), hq = int(row / N % Hq), b = int(row / N / Hq);
  const int G = p.rows.G, hkv = hq / G, rr = (hq % G) * N + n, rg = rr / GROUP_ROWS;
  const int rl = rr % GROUP_ROWS;
  const int64_t prow0 = ((int64_t(b) * p.k.H + hkv) * p.groups + rg) * p.splits * row_tile + rl;
  // The splits' lse, and their max over the CTA.
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < p.splits; s += THREADS) {
    weight[s] = p.part_lse[prow0 + int64_t(s) * row_tile];
    mx = fmaxf(mx, weight[s]);
  }
  mx = tk::warp_max(mx);
  if (lane == 0) reduce[warp] = mx;
  __syncthreads();
  mx = reduce[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, reduce[w]);
  __syncthreads();  // reduce is reused below
  // The weights (all zero where no split saw a key), and their sum.
  float wsum = 0.f;
  for (int s = threadIdx.x; s < p.splits; s += THREADS) {
    const float w = mx > -INFINITY ? __expf(weight[s] - mx) : 0.f;
    weight[s] = w;
    wsum += w;
  }
  wsum = tk::warp_sum(wsum);
  if (lane == 0) reduce[warp] = wsum;
  __syncthreads();  // the weights and the per-warp sums
  wsum = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) wsum += reduce[w];
  float4 acc[PASSES];
#pragma unroll
  for (int ps = 0; ps < PASSES; ++ps) {
    const int col = 4 * lane + 128 * ps;
    acc[ps] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (col < D) {
#pragma unroll 4
      for (int s = warp; s < p.splits; s += WARPS) {
        const float w = weight[s];
        const float4 v = *reinterpret_cast<const float4*>(p.part_o + (prow0 + int64_t(s) * row_tile) * D + col);
        acc[ps].x += w * v.x, acc[ps].y += w * v.y, acc[ps].z += w * v.z, acc[ps].w += w * v.w;
      }
    }
    sums[warp][ps][lane] = acc[ps];
  }
  __syncthreads();
  if (warp != 0) return;
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
  for (int ps = 0; ps < PASSES; ++ps) {
    const int col = 4 * lane + 128 * ps;
    for (int w = 1; w < WARPS; ++w) {
      const float4 o = sums[w][ps][lane];
      acc[ps].x += o.x, acc[ps].y += o.y, acc[ps].z += o.z, acc[ps].w += o.w;
    }
    if (col < D) {
      T* dst = static_cast<T*>(p.o) + ((int64_t(b) * N + n) * Hq + hq) * D + col;
      auto* out = reinterpret_cast<tk::packed_t<T>*>(dst);
      out[0] = tk::make_packed<T>(tk::convert<T>(acc[ps].x * inv), tk::convert<T>(acc[ps].y * inv));
      out[1] = tk::make_packed<T>(tk::convert<T>(acc[ps].z * inv), tk::convert<T>(acc[ps].w * inv));
    }
  }
  if (lane == 0) p.lse[(int64_t(b) * Hq + hq) * N + n] = wsum > 0.f ? mx + __logf(wsum) : INFINITY;
}

template <typename T, int DK, int RT>
constexpr size_t smem_bytes() { return sizeof(Smem<T, DK, RT>) + 1024; }

// Sets the kernel's shared-memory limit (once) and returns its resident CTAs per SM, 0 on failure.
template <typename T, int DK, int RT>
int prepare() {
  static const int per_sm = [] {
    auto kern = decode_kernel<T, DK, RT>;
    int n = 0;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes<T, DK, RT>())) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, THREADS, smem_bytes<T, DK, RT>()) != cudaSuccess)
      return 0;
    return n;
  }();
  return per_sm;
}

template <typename T, int DK, int RT>
const char* launch(const Params& p, cudaStream_t stream) {
  if (prepare<T, DK, RT>() == 0) return "the attention decode kernel cannot be launched (shared memory)";
  // Both launches overlap the previous kernel's tail (programmatic dependent launch; each waits before reading).
  if (tk::grid::launch_dependent(decode_kernel<T, DK, RT>, dim3(p.groups, p.splits, unsigned(p.q.B * p.k.H)),
                                 THREADS, smem_bytes<T, DK, RT>(), stream, p) != cudaSuccess)
    return "attention decode launch failed";
  if (p.splits > 1) {
    const int64_t rows = p.q.B * p.q.H * p.rows.N;
    if (rows > 0x7fffffff ||
        tk::grid::launch_dependent(decode_combine_kernel<T>, unsigned(rows), THREADS, 0, stream, p, 16 * RT) !=
            cudaSuccess)
      return "attention decode merge launch failed";
  }
  return cudaGetLastError() == cudaSuccess ? nullptr : "attention decode launch failed";
}

}  // namespace

template <typename T, int DK>
int decode_occupancy(int row_tiles) {
  return row_tiles == 1 ? prepare<T, DK, 1>() : row_tiles == 2 ? prepare<T, DK, 2>() : prepare<T, DK, 4>();
}

template <typename T, int DK>
const char* decode_launch(const decode::Params& p, int row_tiles, cudaStream_t stream) {
  return row_tiles == 1 ? launch<T, DK, 1>(p, stream)
         : row_tiles == 2 ? launch<T, DK, 2>(p, stream) : launch<T, DK, 4>(p, stream);
}

}  // namespace tk_attn
