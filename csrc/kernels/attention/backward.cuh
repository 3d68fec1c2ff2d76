// Attention backward on Hopper, FA3-style. One CTA per (batch, kv head, key
// block of 128): two consumer warpgroups each own 64 keys and keep dK, dV in
// registers while the producer warpgroup streams (Q, dO) tiles of 64 query
// rows for every query head of the GQA group. Per tile, on wgmma:
//   S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S^T*scale*log2e - lse2),
//   dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q,
//   dQ += dS K   (dS^T goes through shared memory; dQ blocks are added into an
//                 fp32 dq_accum by TMA bulk reduce-add).
// A preprocess kernel computes delta = rowsum(dO * O) and lse2 = lse*log2e
// (padded: lse2 = +inf past N makes P = 0 there), a postprocess scales and
// casts dq_accum.
//
// This header: the configurations, shared memory and the device pieces both main kernels use
// (backward_kernels.cuh: the kernels; backward.cu: the pre/post kernels and the launch).
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>
#include <tuple>
#include <type_traits>

#include "attention.h"
#include "common.cuh"
#include "dropout.cuh"
#include "tma.cuh"

namespace tk_attn {
namespace {

constexpr int BWD_BM = 64;   // query rows per streamed tile
constexpr int BWD_BN = 128;  // keys per CTA (64 per consumer warpgroup)
constexpr int BWD_NC = 2;

// A backward configuration: Kind::Tile64 = attention_bwd_kernel (64-row q tiles), Kind::Wide =
// attention_bwd_wide_kernel (D = 64, 128-row q tiles), Kind::Split = attention_bwd_split_kernel (D = 256, 64 keys,
// the consumers split the head dim); the ring's stages; and a set of bwd:: flags, each explained where the kernels
// read it (Bwd, BwdWide).
enum class Kind { Tile64, Wide, Split };
namespace bwd {
enum : unsigned {
  DBUF = 1u << 1,    // Tile64: dS^T double-buffered (DS2)
  TURNS = 1u << 6,   // Tile64: the consumers take turns at the tensor cores
  PRODQ = 1u << 10,  // a producer warp issues the dQ reduce-adds (bwd_dq_reducer)
};
}  // namespace bwd
template <Kind KIND, int STAGES, unsigned FLAGS = 0>
struct BwdCfg {
  static constexpr Kind kind = KIND;
  static constexpr int stages = STAGES;
  static constexpr bool dbuf = FLAGS & bwd::DBUF, turns = FLAGS & bwd::TURNS, prodq = FLAGS & bwd::PRODQ;
  static constexpr int BM = KIND == Kind::Wide ? 128 : BWD_BM;  // the q tile
  static constexpr int BN = KIND == Kind::Split ? 64 : BWD_BN;   // the keys of a block
};

// The 64-row kernel's shape and switches (Cfg: a BwdCfg; DS2 is bwd::DBUF).
// DS2: dS^T double-buffered (D = 128): the write of step it goes to buffer
// it % 2, last read by step it - 2's dQ, which both consumers finished before
// step it - 1's barrier; so the barrier before the write is not needed.
// TURNS: the consumers take turns at the tensor cores, as the forward's ping-pong does. A step is three turns per
// consumer: [S^T, dP^T], [dV, dK] (dS^T computed and stored inside the turn), [dQ]; consumer 0 goes first. So one
// consumer's exponentials and dS^T run while the other's GEMMs do, and the turn order replaces the CTA-wide
// barriers around dS^T: consumer c's dQ turn comes after the other's [dV, dK] turn, which stored its half (D = 128
// needs DS2: the next step's write to a buffer comes after both dQs that read it have completed).
// PRODQ: a producer warp issues the dQ reduce-adds (bwd_dq_reducer): a consumer hands its staged block over by an
// mbarrier instead of two named barriers and one thread's TMA issue.
// Both kernels take lse2/delta through the ring stage in stats_slot order (load_stats, StatsPairs), branch around
// the mask (bwd_probs), store dS^T and the dQ staging by stmatrix (store_ds, stage_dq) and dK/dV by TMA (store_dkdv).
template <typename T, int D, class Cfg>
struct Bwd {
  static constexpr int BM = BWD_BM, BN = BWD_BN, NC = BWD_NC, STAGES = Cfg::stages;
  static constexpr bool DS2 = Cfg::dbuf, TURNS = Cfg::turns, PRODQ = Cfg::prodq;
  static_assert(Cfg::kind == Kind::Tile64 && D == 128, "the 64-row kernel runs D = 128");
  static_assert(!TURNS || DS2, "TURNS: dS^T double-buffered");
  static constexpr int STATS_BYTES = 2 * BM * 4;  // per stage: lse2[BM], delta[BM]
  static constexpr int EMPTY_ARRIVALS = NC * 4;   // a ring stage is released by lane 0 of each consumer warp
  static constexpr int PANELS = D / 64;
  static constexpr int THREADS = (NC + 1) * 128;
  static_assert(BN == 64 * NC, "each consumer owns 64 keys");
  static constexpr int KV_BYTES = BN * D * 2;  // K or V
  static constexpr int Q_BYTES = BM * D * 2;   // Q or dO tile
  static constexpr int DS_BYTES = BN * BM * 2; // dS^T tile [key][query]
  static constexpr int DQ_COLS = D / NC;  // each consumer computes half of dQ's columns over all BN keys
  static constexpr int DQ_STAGE_BYTES = 64 * DQ_COLS * 4;  // per consumer: 64 rows x DQ_COLS fp32 columns
  static constexpr int DS_BUFS = DS2 ? 2 : 1;
  static constexpr int SMEM = 2 * KV_BYTES + 2 * STAGES * Q_BYTES + DS_BUFS * DS_BYTES + NC * DQ_STAGE_BYTES +
                              STAGES * STATS_BYTES + 1024 + 256;
  static_assert(SMEM <= 227 * 1024, "shared memory");
  // dQ: D=128 splits the output columns between the two consumers (64 each,
  // contracting over all 128 keys); D=64 has each consumer add its own keys'
  // partial (fewer registers is not an issue there, and N=64 keeps one panel).
  // Consumer c's staged dQ block: DQ_BOXES boxes of 32 fp32 columns, box bx at column dq_col(c, bx) and row
  // dq_row(c) of the q tile in dq_accum.
  static constexpr int DQ_BOXES = DQ_COLS / 32;
  static constexpr int DS_PANEL = BN * 128;  // one [BN keys][64 queries] panel of dS^T
  __device__ static constexpr int dq_col(int c, int bx) { return 64 * c + 32 * bx; }
  __device__ static constexpr int dq_row(int) { return 0; }
};

// Shared memory of a backward block (Bwd or BwdWide): the resident K and V, the (Q, dO) ring, the dS^T
// buffers, the per-consumer dQ staging and the mbarriers; thread 0 initialises the barriers, then the block
// syncs.
template <class K_>
struct BwdSmem {
  uint8_t *sK, *sV, *sQ, *sdO, *sdS, *sdQ;
  float* sStats;  // [STAGES][2][BM]: lse2, delta
  tk::semaphore *kv_full, *q_full, *q_empty;
  tk::semaphore *dq_full, *dq_empty;  // per consumer: its dQ block staged / read by the reduce (PRODQ)
  __device__ __forceinline__ explicit BwdSmem(uint8_t* raw) {
    sK = tk::align_shared<1024>(raw);
    sV = sK + K_::KV_BYTES;
    sQ = sV + K_::KV_BYTES;
    sdO = sQ + K_::STAGES * K_::Q_BYTES;
    sdS = sdO + K_::STAGES * K_::Q_BYTES;
    sdQ = sdS + K_::DS_BUFS * K_::DS_BYTES;
    sStats = reinterpret_cast<float*>(sdQ + K_::NC * K_::DQ_STAGE_BYTES);
    kv_full = reinterpret_cast<tk::semaphore*>(reinterpret_cast<uint8_t*>(sStats) + K_::STAGES * K_::STATS_BYTES);
    q_full = kv_full + 1;
    q_empty = q_full + K_::STAGES;
    dq_full = q_empty + K_::STAGES;
    dq_empty = dq_full + K_::NC;
    static_assert((1 + 2 * K_::STAGES + 2 * K_::NC) * 8 <= 256, "the barriers fit in SMEM's last 256 bytes");
  }
  __device__ __forceinline__ void init() const {
    if (threadIdx.x == 0) {
      tk::init_semaphore(*kv_full, 1);
      for (int s = 0; s < K_::STAGES; ++s) {
        tk::init_semaphore(q_full[s], 1);
        tk::init_semaphore(q_empty[s], K_::EMPTY_ARRIVALS);
      }
      for (int c = 0; c < K_::NC; ++c) {
        tk::init_semaphore(dq_full[c], 4);  // lane 0 of each of the consumer's warps
        tk::init_semaphore(dq_empty[c], 1);
      }
      tk::fence_semaphore_init();
    }
    __syncthreads();
  }
};

struct BwdParams {
  int B, Hq, Hkv, N, M, group, Npad;
  float scale, scale_log2;
  // softcap (CAP kernels): s log2 e = cap_log2 * tanh(cap_in * q k^T), as the forward's; cap_inv_log2 = 1 / cap_log2
  float cap_in, cap_log2, cap_inv_log2;
  bool causal;
  int window;  // causal sliding window: key j hidden from query i when i - j >= window (INT_MAX: none)
  const int* key_rows;  // (B, M, 2): the queries [x, y] that may see each key (Scores::key_rows); null: all
  Dropout drop;         // the DROP kernels' stream (dropout.cuh)
  const float* lse2;   // (B*Hq, Npad)
  const float* delta;  // (B*Hq, Npad)
  float* dq_accum;     // (B*Hq, Npad, D)
  int nk;       // key blocks per kv head
  int section;  // kv heads per section of the block order (bwd_section)
};

// A backward block's place: batch b, kv head hk, keys [n0, n0 + BN), and its steps: one (Q, dO) tile per q block in
// [mb_start, mb_end), for every query head of the GQA group (step it: head it / steps_per_head).
struct BwdBlock {
  int b, hk, n0, mb_start, mb_end, steps_per_head, steps;
  __device__ __forceinline__ int mb(int it) const { return mb_start + it % steps_per_head; }  // q block of step it
  __device__ __forceinline__ int head(int it, const BwdParams& p) const { return hk * p.group + it / steps_per_head; }
};

// The queries [x, y] that may see key j of batch entry b by Scores::key_rows, clamped to the queries (keys past M:
// none). Nondecreasing in x and y along the keys below M.
__device__ __forceinline__ int2 key_bounds(const BwdParams& p, int b, int j) {
  if (j >= p.M) return make_int2(p.N, -1);
  const int2 v = interval(p.key_rows, b, p.M, j, make_int2(0, p.N - 1));
  return make_int2(max(v.x, 0), min(v.y, p.N - 1));
}

// This block's BwdBlock. Block blockIdx.x -> (batch * kv head, key block) by section_decode, key blocks first to
// last: under causal key block 0 is the heaviest (every query block sees it), so the hardware's in-order dispatch
// starts the heavy blocks of a section's heads first and the light ones fill the tail. The block's queries run from
// its first key's first query (key_bounds; under a causal mask not before the first key) to its last key's last
// query (with a window, not after that key + window - 1); a block that no query sees has no steps (dK = dV = 0).
template <int BM, int BN>
__device__ __forceinline__ BwdBlock bwd_block(const BwdParams& p) {
  int bh, kb;
  section_decode(static_cast<int>(blockIdx.x), p.B * p.Hkv, p.nk, p.section, bh, kb);
  const int b = bh / p.Hkv, n0 = kb * BN;
  const int last_key = min(n0 + BN, p.M) - 1;
  const int first = max(key_bounds(p, b, n0).x, p.causal ? n0 : 0);
  const int last = min(key_bounds(p, b, last_key).y, last_key + min(p.window, p.N) - 1);
  const int mb_start = first / BM;
  const int mb_end = min((p.N + BM - 1) / BM, last / BM + 1);
  const int steps_per_head = first <= last ? max(0, mb_end - mb_start) : 0;
  return {b, bh - b * p.Hkv, n0, mb_start, mb_end, steps_per_head, steps_per_head * p.group};
}

// A consumer's 64 keys [j0, j0 + 64) of batch entry b as the mask sees them: each of this thread's two keys' queries
// (kq, key_bounds) and the queries all 64 keys may be seen by, [lo, hi] (a tile inside needs no mask).
struct KeyMask {
  int2 kq[2];
  int lo, hi;
  __device__ __forceinline__ KeyMask(const BwdParams& p, int b, int j0, int j)
      : kq{key_bounds(p, b, j), key_bounds(p, b, j + 8)}, lo(key_bounds(p, b, j0 + 63).x), hi(key_bounds(p, b, j0).y) {}
};

// Whether a step's tile (queries [i0, i0 + BM), the consumer's keys [j0, j0 + 64)) has an entry the mask hides.
template <int BM>
__device__ __forceinline__ bool bwd_need_mask(const BwdParams& p, const KeyMask& km, int i0, int j0) {
  return (p.causal && i0 < j0 + 63) || i0 < km.lo || i0 + BM - 1 > km.hi || i0 + BM - 1 - j0 >= p.window;
}

// lse2 and delta are laid out in groups of 32 rows with row 8 k + 2 q + e at slot 8 q + 2 k + e, so that
// the pairs one thread reads (rows 8 k + col_in, +1 of chunks k; col_in = 2 q) are contiguous over four chunks: one
// 16-byte load per two chunks instead of two 8-byte ones (the consumers' shared-memory instructions queue on MIO).
__host__ __device__ constexpr int stats_slot(int r) {
  return (r & ~31) | (((r >> 1) & 3) << 3) | (((r >> 3) & 3) << 1) | (r & 1);
}

// The (lse2 or delta) pair of chunk ch for this thread: values of rows 8 ch + col_in, +1 of `row` (in the ring
// stage, stats_slot order). Called for ch = 0, 1, ... in order: the even chunk loads both.
struct StatsPairs {
  const float* row;
  int col_in;
  float4 quad;
  __device__ __forceinline__ float2 operator()(int ch) {
    if (ch % 2 == 0) quad = load_quad<true>(row + 32 * (ch / 4) + 4 * col_in + 2 * (ch % 4));
    return ch % 2 ? make_float2(quad.z, quad.w) : make_float2(quad.x, quad.y);
  }
};

// P^T = 2^(S^T * scale_log2 - lse2) in place over this thread's part of a consumer's 64 keys x BM queries (rows
// j0, j0 + 8; columns i0 + 8 ch + col_in, +1), zero on the causal upper triangle, left of the window and outside
// each key's queries (km.kq; keys past M have none: their zero-filled rows would otherwise give 2^-lse2, which can
// overflow for extreme scales). need_mask
// says whether this consumer's block of the step has any such entry; lse_row is the step's lse2 in the ring stage.
// 2^x by the MUFU alone (ex2_ftz: P needs no range fix-up). A warp-uniform branch picks a masked or an unmasked
// compiled block, so the mask's arithmetic is not predicated into every step.
// CAP: the scores are softcapped first, z = cap * tanh(cap_in * s), and P = 2^(z log2 e - lse2).
template <int BM, bool CAP>
__device__ __forceinline__ void bwd_probs(float (&st)[BM / 2], const float* lse_row, const BwdParams& p,
                                          const KeyMask& km, int i0, int j0, int col_in, bool need_mask) {
  // mode 0: no mask; 1: masked
  const auto block = [&](auto mode) {
    StatsPairs lse{lse_row, col_in};
#pragma unroll
    for (int ch = 0; ch < BM / 8; ++ch) {
      const float2 l2 = lse(ch);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float z = CAP ? tk::tanh_approx(st[4 * ch + e] * p.cap_in) * p.cap_log2 : st[4 * ch + e] * p.scale_log2;
        float pe = tk::ex2_approx(z - ((e & 1) ? l2.y : l2.x));
        if (decltype(mode)::value == 1) {
          const int i = i0 + 8 * ch + col_in + (e & 1);
          const int j = j0 + 8 * (e >> 1);
          const int2 kq = km.kq[e >> 1];
          if ((p.causal && i < j) || i < kq.x || i > kq.y || i - j >= p.window) pe = 0.f;
        }
        st[4 * ch + e] = pe;
      }
    }
  };
  if (need_mask)
    block(std::integral_constant<int, 1>{});
  else
    block(std::integral_constant<int, 0>{});
}

// dS^T = P^T (dP^T - delta) in place over dpt, from P^T in st (bwd_probs). CAP: times dz/ds (over scale) of the
// softcapped score z = cap t, t = tanh(cap_in s), that is 1 - t^2; t comes back from P = 2^(z log2 e - lse2) as
// (log2 P + lse2) / (cap log2 e), so no tanh stays in registers between the exponential and dS. P = 0 (masked or
// underflowed; lse2 = +inf on padded rows) clamps t to -1 or 1, and the factor to 0. DROP: dpt is the gradient of
// the dropped probabilities, so dP^T = keep dpt / (1 - p) (keep: Dropout::keep_tile's flags).
template <int BM, bool CAP, bool DROP = false>
__device__ __forceinline__ void bwd_ds(float (&dpt)[BM / 2], const float (&st)[BM / 2], const float* lse_row,
                                       const float* del_row, const BwdParams& p, int col_in, uint64_t keep = 0) {
  StatsPairs del{del_row, col_in}, lse{lse_row, col_in};
#pragma unroll
  for (int ch = 0; ch < BM / 8; ++ch) {
    const float2 dl = del(ch);
    float2 l2;
    if constexpr (CAP) l2 = lse(ch);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float dp = dpt[4 * ch + e];
      if constexpr (DROP) dp = (keep >> (4 * ch + e)) & 1u ? dp * p.drop.scale : 0.f;
      float ds = st[4 * ch + e] * (dp - ((e & 1) ? dl.y : dl.x));
      if constexpr (CAP) {
        const float t = (tk::lg2_approx(st[4 * ch + e]) + ((e & 1) ? l2.y : l2.x)) * p.cap_inv_log2;
        const float tc = fmaxf(-1.f, fminf(1.f, t));
        ds *= 1.f - tc * tc;
      }
      dpt[4 * ch + e] = ds;
    }
  }
}

// Copy lse2[bh, i0 : i0 + BM] and delta[bh, i0 : i0 + BM] into dst[0 : BM], dst[BM : 2 BM] on `bar`.
// The rows are padded to a multiple of the q tile, so the copy never leaves them.
// Raw byte copies: as 2-D tensor copies they cost the 24-register producer loops around each copy (and spills at
// D = 64); the D = 128 causal backward ran 3.5% slower on the H200.
template <int BM>
__device__ __forceinline__ void load_stats(float* dst, const BwdParams& p, int bh, int i0, tk::semaphore* bar) {
  const int64_t row = static_cast<int64_t>(bh) * p.Npad + i0;
  tk::tma::load_bytes_async(dst, p.lse2 + row, BM * 4, *bar);
  tk::tma::load_bytes_async(dst + BM, p.delta + row, BM * 4, *bar);
}

// This warp's part of dS^T -- the A slices of dK += dS^T Q: key rows jw + lane / 4, +8; query columns col0 +
// 16 kk + 2 (lane % 4), +1, +8, +9 -- into the buffer at ds_u ([query panel][BN keys][64], 128-byte swizzle): one
// stmatrix per slice (its register order is the A slice's), where 4-byte stores filled the MIO queue.
template <int BM, int PANEL>
__device__ __forceinline__ void store_ds(uint32_t ds_u, const uint32_t (&dsa)[BM / 16][4], int jw, int lane,
                                         int col0 = 0) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
    const int col = col0 + 16 * kk;
    const int ip = col / 64 * PANEL;  // the slice's query panel
    stmatrix_x4(ds_u + ip + swz128(jw + stsm_row(lane), col % 64 + stsm_byte(lane) / 2, 2), dsa[kk][0],
                dsa[kk][1], dsa[kk][2], dsa[kk][3]);
  }
}

// This warp's dQ accumulator (rows rw + lane / 4, +8 of the consumer's 64; 8-column chunks) into its stage at
// stage_u: [COLS / 32 boxes][64 rows][32 fp32], 128-byte swizzle, the layout of the reduce-add's boxes, by
// stmatrix, one instruction per 8-column chunk; stmatrix puts a lane's register in 4 bytes of a 16-byte row, so
// each chunk lands as its 4 even columns, then its 4 odd ones. dq_accum holds that order and the post kernel
// restores it.
template <int COLS>
__device__ __forceinline__ void stage_dq(uint32_t stage_u, const float (&dq)[COLS / 2], int rw, int lane) {
#pragma unroll
  for (int ch = 0; ch < COLS / 8; ++ch) {
    const uint32_t box = stage_u + (8 * ch / 32) * 8192;
    stmatrix_x4(box + swz128(rw + stsm_row(lane), (8 * ch) % 32 + stsm_byte(lane) / 4, 4),
                __float_as_uint(dq[4 * ch]), __float_as_uint(dq[4 * ch + 2]), __float_as_uint(dq[4 * ch + 1]),
                __float_as_uint(dq[4 * ch + 3]));
  }
}

// Consumer c's dQ block of step `it` (dq: this warp's rows; COLS columns) into its stage and on to dq_accum at
// (bh, q rows from i0) by TMA reduce-add, so no atomics sit on the consumers' critical path (rows past N land in
// dq_accum's padding). PRODQ: the reducer warp issues the reduce-adds (bwd_dq_reducer), handed over by mbarriers;
// else thread 0 does, behind two named barriers.
template <class K_, int COLS>
__device__ __forceinline__ void hand_over_dq(const BwdSmem<K_>& sm, const CUtensorMap* dqmap,
                                             const float (&dq)[COLS / 2], int it, int c, int tid, int i0, int bh) {
  const int warp = tid / 32, lane = tid % 32;
  uint8_t* stage = sm.sdQ + c * K_::DQ_STAGE_BYTES;
  if constexpr (K_::PRODQ) {
    if (it > 0) tk::wait(sm.dq_empty[c], (it - 1) & 1);  // the reducer has read the previous block
    stage_dq<COLS>(tk::smem_addr(stage), dq, 16 * warp, lane);
    tk::fence_async_shared();
    __syncwarp();
    if (lane == 0) tk::arrive(sm.dq_full[c]);
  } else {
    if (tid == 0) tk::tma::store_read_wait();  // the previous reduce has read the stage
    tk::named_sync(3 + c, 128);
    stage_dq<COLS>(tk::smem_addr(stage), dq, 16 * warp, lane);
    tk::fence_async_shared();
    tk::named_sync(3 + c, 128);
    if (tid == 0) {
#pragma unroll
      for (int bx = 0; bx < K_::DQ_BOXES; ++bx)
        tk::tma::reduce_add_async(dqmap, stage + bx * 8192, K_::dq_col(c, bx), i0 + K_::dq_row(c), bh);
      tk::tma::store_commit();
    }
  }
}

// The producer warpgroup of both backward kernels. Thread 0 loads the block's K and V once, then streams the
// steps' (Q, dO) tiles and their lse2/delta rows through the ring.
template <class K_>
__device__ __forceinline__ void bwd_producer(const BwdSmem<K_>& sm, const BwdParams& p,
                                             const BwdBlock& blk, const CUtensorMap* qmap,
                                             const CUtensorMap* kmap, const CUtensorMap* vmap,
                                             const CUtensorMap* domap, int tid) {
  constexpr int BM = K_::BM, BN = K_::BN, STAGES = K_::STAGES;
  tk::warpgroup::decrease_registers<24>();
  if (tid == 0) {
    tk::expect_bytes(*sm.kv_full, 2 * K_::KV_BYTES);
#pragma unroll
    for (int pn = 0; pn < K_::PANELS; ++pn) {
      tk::tma::load_async(sm.sK + pn * BN * 128, kmap, *sm.kv_full, pn * 64, blk.n0, blk.hk, blk.b);
      tk::tma::load_async(sm.sV + pn * BN * 128, vmap, *sm.kv_full, pn * 64, blk.n0, blk.hk, blk.b);
    }
    for (int it = 0; it < blk.steps; ++it) {
      const int mb = blk.mb(it), h = blk.head(it, p);
      const int s = it % STAGES;
      tk::wait(sm.q_empty[s], ((it / STAGES) & 1) ^ 1);
      tk::expect_bytes(sm.q_full[s], 2 * K_::Q_BYTES + K_::STATS_BYTES);
      load_stats<BM>(sm.sStats + s * 2 * BM, p, blk.b * p.Hq + h, mb * BM, &sm.q_full[s]);
#pragma unroll
      for (int pn = 0; pn < K_::PANELS; ++pn) {
        tk::tma::load_async(sm.sQ + s * K_::Q_BYTES + pn * BM * 128, qmap, sm.q_full[s], pn * 64, mb * BM, h, blk.b);
        tk::tma::load_async(sm.sdO + s * K_::Q_BYTES + pn * BM * 128, domap, sm.q_full[s], pn * 64, mb * BM, h, blk.b);
      }
    }
  }
}

// PRODQ: one producer thread adds the consumers' staged dQ blocks into dq_accum, step by step: wait until consumer c
// has staged (dq_full[c]), issue its boxes' reduce-adds, and once they have read the stage, hand it back
// (dq_empty[c]).
template <class K_>
__device__ __forceinline__ void bwd_dq_reducer(const BwdSmem<K_>& sm, const BwdParams& p, const BwdBlock& blk,
                                               const CUtensorMap* dqmap) {
  for (int it = 0; it < blk.steps; ++it) {
    const int bh = blk.b * p.Hq + blk.head(it, p), i0 = blk.mb(it) * K_::BM;
#pragma unroll
    for (int c = 0; c < K_::NC; ++c) {
      const uint8_t* stage = sm.sdQ + c * K_::DQ_STAGE_BYTES;
      tk::wait(sm.dq_full[c], it & 1);
#pragma unroll
      for (int bx = 0; bx < K_::DQ_BOXES; ++bx)
        tk::tma::reduce_add_async(dqmap, stage + bx * 8192, K_::dq_col(c, bx), i0 + K_::dq_row(c), bh);
      tk::tma::store_commit();
      tk::tma::store_read_wait();
      tk::arrive(sm.dq_empty[c]);
    }
  }
  tk::tma::store_wait();
}

// The producer warpgroup of both kernels: the (Q, dO) stream by thread 0 and, with PRODQ, the dQ reducer warp.
template <class K_>
__device__ __forceinline__ void bwd_producer_warpgroup(const BwdSmem<K_>& sm, const BwdParams& p, const BwdBlock& blk,
                                                       const CUtensorMap* qmap, const CUtensorMap* kmap,
                                                       const CUtensorMap* vmap, const CUtensorMap* domap,
                                                       const CUtensorMap* dqmap, int tid) {
  bwd_producer<K_>(sm, p, blk, qmap, kmap, vmap, domap, tid);
  if constexpr (K_::PRODQ) {
    if (tid == 32) bwd_dq_reducer<K_>(sm, p, blk, dqmap);
  }
}

// The TMA maps of dK and dV (B, Hkv, M, D), boxes of 64 columns x 64 keys (store_dkdv).
struct DkvMaps {
  CUtensorMap dk, dv;
};

// dK (scaled) and dV (times dv_scale: dropout's 1 / (1 - p)) of consumer c: 64 keys from key0 (this thread's rows
// row_in, row_in + 8) by COLS head-dim columns from col0. Once both consumers are past their last step (the other's
// last wgmmas may still read the ring), each writes its tiles into the drained (Q, dO) ring and one thread stores them by TMA (full 128-byte
// lines, keys past M clipped), where 4-byte stores from registers filled half of each 32-byte sector.
template <typename T, int COLS, class K_>
__device__ __forceinline__ void store_dkdv(const BwdSmem<K_>& sm, const BwdParams& p, const DkvMaps& maps,
                                           const float (&dk)[COLS / 2], const float (&dv)[COLS / 2], int b, int hk,
                                           int key0, int col0, int c, int tid, int row_in, int col_in,
                                           float dv_scale = 1.f) {
  constexpr int TILE = 64 * COLS * 2;  // one consumer's dK (or dV), [COLS / 64 panels][64 keys][64]
  static_assert(K_::STAGES * K_::Q_BYTES >= K_::NC * TILE, "dK and dV tiles fit in the (Q, dO) ring");
  tk::named_sync(5, K_::NC * 128);  // an id of its own
  const uint32_t k_u = tk::smem_addr(sm.sQ) + c * TILE, v_u = tk::smem_addr(sm.sdO) + c * TILE;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
    for (int ch = 0; ch < COLS / 8; ++ch) {
      const uint32_t off = (ch / 8) * 64 * 128 + swz128(row_in + 8 * h2, 8 * (ch % 8) + col_in, 2);
      tk::st_shared(k_u + off, pack2<T>(dk[4 * ch + 2 * h2] * p.scale, dk[4 * ch + 2 * h2 + 1] * p.scale));
      tk::st_shared(v_u + off, pack2<T>(dv[4 * ch + 2 * h2] * dv_scale, dv[4 * ch + 2 * h2 + 1] * dv_scale));
    }
  tk::fence_async_shared();
  tk::named_sync(3 + c, 128);
  if (tid == 0) {
#pragma unroll
    for (int pn = 0; pn < COLS / 64; ++pn) {
      tk::tma::store_async(&maps.dk, sm.sQ + c * TILE + pn * 64 * 128, col0 + pn * 64, key0, hk, b);
      tk::tma::store_async(&maps.dv, sm.sdO + c * TILE + pn * 64 * 128, col0 + pn * 64, key0, hk, b);
    }
    tk::tma::store_commit();
    tk::tma::store_wait();  // shared memory stays allocated until the stores have read it
  }
}

}  // namespace
}  // namespace tk_attn
