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
#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

#include "attention.h"
#include "common.cuh"
#include "tma.cuh"

namespace tk_attn {
namespace {

constexpr int BWD_BM = 64;   // query rows per streamed tile
constexpr int BWD_BN = 128;  // keys per CTA (64 per consumer warpgroup)
constexpr int BWD_NC = 2;

// A backward configuration: Kind::Tile64 = attention_bwd_kernel (64-row q tiles), Kind::Wide =
// attention_bwd_wide_kernel (D = 64, 128-row q tiles); the ring's stages; and a set of bwd:: flags, each
// explained where the kernels read it (Bwd, BwdWide).
enum class Kind { Tile64, Wide };
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
        tk::init_semaphore(q_empty[s], K_::NC * 4);
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
  bool causal;
  const float* lse2;   // (B*Hq, Npad)
  const float* delta;  // (B*Hq, Npad)
  float* dq_accum;     // (B*Hq, Npad, D)
  int nk;       // key blocks per kv head
  int section;  // kv heads per section of the block order (bwd_section)
};

// Block blockIdx.x -> (batch * kv head, key block) by section_decode, key block ranks first-to-last: under causal
// key block 0 is the heaviest (every query block sees it), so the hardware's in-order dispatch starts the heavy
// blocks of a section's heads first and the light ones fill the tail.
__device__ __forceinline__ void decode_bwd_block(const BwdParams& p, int& b, int& hk, int& kb) {
  int bh;
  section_decode(static_cast<int>(blockIdx.x), p.B * p.Hkv, p.nk, p.section, bh, kb);
  b = bh / p.Hkv;
  hk = bh - b * p.Hkv;
}

// A backward block's place: batch b, kv head hk, keys [n0, n0 + BN), and its steps: one (Q, dO) tile per q
// block from mb_start on, for every query head of the GQA group (step it: head it / steps_per_head).
struct BwdBlock {
  int b, hk, n0, mb_start, steps_per_head, steps;
  __device__ __forceinline__ int mb(int it) const { return mb_start + it % steps_per_head; }  // q block of step it
  __device__ __forceinline__ int head(int it, const BwdParams& p) const { return hk * p.group + it / steps_per_head; }
};

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
// j0, j0 + 8; columns i0 + 8 ch + col_in, +1), zero on the causal upper triangle and on keys past M (their
// zero-filled rows would otherwise give 2^-lse2, which can overflow for extreme scales). need_mask says whether
// this consumer's block of the step has any such entry; lse_row is the step's lse2 in the ring stage. 2^x by the
// MUFU alone (ex2_ftz: P needs no range fix-up). A warp-uniform branch picks a masked or an unmasked compiled block,
// so the mask's arithmetic is not predicated into every step.
template <int BM>
__device__ __forceinline__ void bwd_probs(float (&st)[BM / 2], const float* lse_row, const BwdParams& p, int i0,
                                          int j0, int col_in, bool need_mask) {
  // mode 0: no mask; 1: masked
  const auto block = [&](auto mode) {
    StatsPairs lse{lse_row, col_in};
#pragma unroll
    for (int ch = 0; ch < BM / 8; ++ch) {
      const float2 l2 = lse(ch);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = st[4 * ch + e] * p.scale_log2 - ((e & 1) ? l2.y : l2.x);
        float pe = tk::ex2_approx(x);
        if (decltype(mode)::value == 1) {
          const int i = i0 + 8 * ch + col_in + (e & 1);
          const int j = j0 + 8 * (e >> 1);
          if ((p.causal && i < j) || j >= p.M) pe = 0.f;
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

// This warp's part of dS^T -- the A slices of dK += dS^T Q: key rows jw + lane / 4, +8; query columns 16 kk +
// 2 (lane % 4), +1, +8, +9 -- into the buffer at ds_u ([query panel][BN keys][64], 128-byte swizzle): one
// stmatrix per slice (its register order is the A slice's), where 4-byte stores filled the MIO queue.
template <int BM, int PANEL>
__device__ __forceinline__ void store_ds(uint32_t ds_u, const uint32_t (&dsa)[BM / 16][4], int jw, int lane) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
    const int ip = (16 * kk) / 64 * PANEL;  // the slice's query panel
    stmatrix_x4(ds_u + ip + swz128(jw + stsm_row(lane), (16 * kk) % 64 + stsm_byte(lane) / 2, 2), dsa[kk][0],
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

// The TMA maps of dK and dV (B, Hkv, M, D), boxes of 64 columns x 64 keys (store_dkdv).
struct DkvMaps {
  CUtensorMap dk, dv;
};

// dK (scaled) and dV of consumer c's 64 keys, j0 and j0 + 8 being this thread's rows: once both consumers are past
// their last step (the other's last wgmmas may still read the ring), each writes its tiles into the drained (Q, dO)
// ring and one thread stores them by TMA (full 128-byte lines, keys past M clipped), where 4-byte stores from
// registers filled half of each 32-byte sector.
template <typename T, int D, class K_>
__device__ __forceinline__ void store_dkdv(const BwdSmem<K_>& sm, const BwdParams& p, const DkvMaps& maps,
                                           const float (&dk)[D / 2], const float (&dv)[D / 2], int b, int hk, int n0,
                                           int c, int tid, int j0, int col_in) {
  constexpr int TILE = 64 * D * 2;  // one consumer's dK (or dV), [D / 64 panels][64 keys][64]
  static_assert(K_::STAGES * K_::Q_BYTES >= K_::NC * TILE, "dK and dV tiles fit in the (Q, dO) ring");
  tk::named_sync(5, K_::NC * 128);  // an id of its own
  const uint32_t k_u = tk::smem_addr(sm.sQ) + c * TILE, v_u = tk::smem_addr(sm.sdO) + c * TILE;
  const int row_in = j0 - n0 - 64 * c;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
    for (int ch = 0; ch < D / 8; ++ch) {
      const uint32_t off = (ch / 8) * 64 * 128 + swz128(row_in + 8 * h2, 8 * (ch % 8) + col_in, 2);
      tk::st_shared(k_u + off, pack2<T>(dk[4 * ch + 2 * h2] * p.scale, dk[4 * ch + 2 * h2 + 1] * p.scale));
      tk::st_shared(v_u + off, pack2<T>(dv[4 * ch + 2 * h2], dv[4 * ch + 2 * h2 + 1]));
    }
  tk::fence_async_shared();
  tk::named_sync(3 + c, 128);
  if (tid == 0) {
#pragma unroll
    for (int pn = 0; pn < D / 64; ++pn) {
      tk::tma::store_async(&maps.dk, sm.sQ + c * TILE + pn * 64 * 128, pn * 64, n0 + 64 * c, hk, b);
      tk::tma::store_async(&maps.dv, sm.sdO + c * TILE + pn * 64 * 128, pn * 64, n0 + 64 * c, hk, b);
    }
    tk::tma::store_commit();
    tk::tma::store_wait();  // shared memory stays allocated until the stores have read it
  }
}

template <typename T, int D, class Cfg>
__global__ void __launch_bounds__(Bwd<T, D, Cfg>::THREADS, 1)
    attention_bwd_kernel(const __grid_constant__ CUtensorMap qmap, const __grid_constant__ CUtensorMap kmap,
                         const __grid_constant__ CUtensorMap vmap, const __grid_constant__ CUtensorMap domap,
                         const __grid_constant__ CUtensorMap dqmap, const __grid_constant__ DkvMaps dkv,
                         const BwdParams p) {
  using K_ = Bwd<T, D, Cfg>;
  // What BwdConfig runs on this kernel (D = 128): the consumers take turns, dS^T double-buffered, dQ by columns.
  static_assert(D == 128 && K_::TURNS && K_::DS2,
                "the 64-row kernel runs D = 128 with TURNS and DS2");
  constexpr int BM = K_::BM, BN = K_::BN, NC = K_::NC, STAGES = K_::STAGES;
  extern __shared__ uint8_t smem_raw[];
  // K, V: [PANELS][BN][64]; Q, dO: [STAGES][PANELS][BM][64]; dS^T: [DS_BUFS][BN][BM] (one 64-wide panel);
  // dQ staging: [NC][64 cols / 32][64 rows][32 fp32], 128-byte swizzle
  const BwdSmem<K_> sm(smem_raw);
  uint8_t *sK = sm.sK, *sV = sm.sV, *sQ = sm.sQ, *sdO = sm.sdO, *sdS = sm.sdS;
  tk::semaphore *kv_full = sm.kv_full, *q_full = sm.q_full, *q_empty = sm.q_empty;

  int b, hk, kb;
  decode_bwd_block(p, b, hk, kb);
  const int n0 = kb * BN;
  // Causal (top-left): query row i sees keys j <= i, so rows below n0 see none of this block.
  const int mb_start = p.causal ? n0 / BM : 0;
  const int nqb = (p.N + BM - 1) / BM;
  const int steps_per_head = max(0, nqb - mb_start);
  const int steps = steps_per_head * p.group;

  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  sm.init();

  if (wg == 0) {  // ---------------- producer ----------------
    const BwdBlock blk{b, hk, n0, mb_start, steps_per_head, steps};
    bwd_producer<K_>(sm, p, blk, &qmap, &kmap, &vmap, &domap, tid);
    if constexpr (K_::PRODQ) {
      if (tid == 32) bwd_dq_reducer<K_>(sm, p, blk, &dqmap);
    }
    return;
  }

  // ---------------- consumers ----------------
  tk::warpgroup::increase_registers<240>();
  const int c = tk::warp_uniform(wg - 1);  // uniform: the descriptors below stay in uniform registers
  const int warp = tid / 32, lane = tid % 32;
  const int row_in = 16 * warp + lane / 4;
  const int col_in = 2 * (lane % 4);
  const int j0 = n0 + 64 * c + row_in;  // this thread's keys: j0 and j0 + 8
  const uint32_t sK_u = tk::smem_addr(sK), sV_u = tk::smem_addr(sV), sQ_u = tk::smem_addr(sQ), sdO_u = tk::smem_addr(sdO);
  const uint32_t sdS_u = tk::smem_addr(sdS);

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

  // TURNS: this consumer's turns at the tensor cores (named barriers 6 + c).
  using Turn = Turns<K_::TURNS, 6, NC>;

  // S^T = K Q^T (after waiting for the step's tile) and dP^T = V dO^T of
  // step `it_`, one commit group each.
  auto issue_s = [&](int it_, float (&st_)[BM / 2]) {
    const int s_ = it_ % STAGES;
    tk::wait(q_full[s_], (it_ / STAGES) & 1);
    const uint64_t ka = desc_kmajor(sK_u + c * 64 * 128), qb = desc_kmajor(sQ_u + s_ * K_::Q_BYTES);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      tk::warpgroup::mma_ss<T, 0, 0>(st_, kmajor_step(ka, kk, BN), kmajor_step(qb, kk, BM), kk > 0);
    tk::warpgroup::mma_commit();
  };
  auto issue_dp = [&](int it_, float (&dpt_)[BM / 2]) {
    const int s_ = it_ % STAGES;
    const uint64_t va = desc_kmajor(sV_u + c * 64 * 128), ob = desc_kmajor(sdO_u + s_ * K_::Q_BYTES);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      tk::warpgroup::mma_ss<T, 0, 0>(dpt_, kmajor_step(va, kk, BN), kmajor_step(ob, kk, BM), kk > 0);
    tk::warpgroup::mma_commit();
  };

  tk::wait(*kv_full, 0);
  float st[BM / 2], dpt[BM / 2];
  // One step (one streamed (Q, dO) tile), in three turns: [S^T, dP^T], [dV, dK], [dQ].
  // (head in the group, q block) of the step, advanced at its end: no division per step.
  int g_it = 0, mb_it = mb_start;
  auto step = [&](int it) {
    const int g = g_it;
    const int mb = mb_it;
    const int bh = (b * p.Hkv + hk) * p.group + g;  // query head index b*Hq + h
    const int i0 = mb * BM;
    const int s = it % STAGES;
    const uint32_t qs = sQ_u + s * K_::Q_BYTES, dos = sdO_u + s * K_::Q_BYTES;

    const float* lse_row = sm.sStats + s * 2 * BM;  // the step's lse2 and delta, in the ring stage
    const float* del_row = lse_row + BM;
    tk::wait(q_full[s], (it / STAGES) & 1);  // before the turn: not while holding it
    Turn::take(c, [&] {
      issue_s(it, st);
      issue_dp(it, dpt);
    });
    tk::warpgroup::mma_async_wait<1>();
    tk::warpgroup::hold(st);
    const bool need_mask = (p.causal && i0 < n0 + 64 * c + 63) || n0 + 64 * c + 64 > p.M;
    bwd_probs<BM>(st, lse_row, p, i0, j0, col_in, need_mask);
    uint32_t pa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) acc_to_a<T>(pa[kk], st, kk);
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(dpt);
    Turn::wait(c);
    // dV += P^T dO (dO is [query][d]: MN-major B operand)
    const uint64_t dob = desc_mnmajor(dos, BM * 128);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) tk::warpgroup::mma_rs<T, 1>(dv, pa[kk], mnmajor_step(dob, kk), 1);
    tk::warpgroup::mma_commit();
    StatsPairs del{del_row, col_in};
#pragma unroll
    for (int ch = 0; ch < BM / 8; ++ch) {
      const float2 dl = del(ch);
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[4 * ch + e] = st[4 * ch + e] * (dpt[4 * ch + e] - ((e & 1) ? dl.y : dl.x));
    }
    uint32_t dsa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) acc_to_a<T>(dsa[kk], dpt, kk);
    // dK += dS^T Q (fence: the A registers were written after the last fence)
    const uint64_t qsb = desc_mnmajor(qs, BM * 128);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) tk::warpgroup::mma_rs<T, 1>(dk, dsa[kk], mnmajor_step(qsb, kk), 1);
    tk::warpgroup::mma_commit();

    // dS^T to shared memory for dQ = dS K, into the buffer step it - 2's dQ read last (DS2: see Bwd).
    const uint32_t ds_off = (it & 1) * K_::DS_BYTES;
    store_ds<BM, K_::DS_PANEL>(sdS_u + ds_off, dsa, 64 * c + 16 * warp, lane);
    tk::fence_async_shared();
    // bar.arrive orders the dS^T stores before the other consumer's wait for its dQ turn
    Turn::pass(c);
    Turn::wait(c);

    // columns [64c, 64c+64) of dQ, contracting over all BN keys
    float dq[K_::DQ_COLS / 2];
    tk::warpgroup::mma_fence();
    const uint64_t dsa0 = desc_mnmajor(sdS_u + ds_off, BN * 128), kb0 = desc_mnmajor(sK_u + c * BN * 128, BN * 128);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      tk::warpgroup::mma_ss<T, 1, 1>(dq, mnmajor_step(dsa0, kk), mnmajor_step(kb0, kk), kk > 0);
    tk::warpgroup::mma_commit();
    Turn::pass(c);
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(dq);
    tk::warpgroup::hold(dk);
    tk::warpgroup::hold(dv);
    tk::warpgroup::hold(pa);
    tk::warpgroup::hold(dsa);
    __syncwarp();
    if (lane == 0) tk::arrive(q_empty[s]);
    hand_over_dq<K_, K_::DQ_COLS>(sm, &dqmap, dq, it, c, tid, i0, bh);
    mb_it = mb_it + 1 < nqb ? mb_it + 1 : (++g_it, mb_start);
  };
  if (c == NC - 1) Turn::pass(c);  // consumer 0 takes the first turn
  for (int it = 0; it < steps; ++it) step(it);
  if (c == 0) Turn::wait(c);  // the last consumer's final hand-over
  if (tid == 0) tk::tma::store_wait();

  store_dkdv<T, D, K_>(sm, p, dkv, dk, dv, b, hk, n0, c, tid, j0, col_in);
}

// D = 64 with q tiles of 128 rows. At D = 64 every GEMM of a
// 64-row kernel is 64 x 64 x 64, so the per-tile fixed costs (the (Q, dO)
// stream, the named barriers, the dQ staging) weigh twice as much per FLOP as
// at D = 128, and each consumer's dQ partial covers only its own 64 keys: the
// reduce-adds into dq_accum cost N*M*4 bytes per head, twice D = 128's per
// FLOP. Here a step covers 128 query rows: Sᵀ and dPᵀ are 64 x 128 per
// consumer (m64n128), dV and dK contract over 128 rows, and dQ is split by
// rows: consumer c computes rows [64c, 64c+64) of the tile over all 128 keys
// of the CTA, so dq_accum receives one partial per 128 keys (half the
// reduce-add traffic) and each step's fixed costs are spread over twice the
// work. dSᵀ is double-buffered so that one CTA-wide barrier per step suffices.

template <typename T, class Cfg>
struct BwdWide {
  static constexpr int D = 64, BM = 128, BN = BWD_BN, NC = BWD_NC, STAGES = Cfg::stages;
  static constexpr bool PRODQ = Cfg::prodq;
  static_assert(Cfg::kind == Kind::Wide && Cfg::BM == BM && !Cfg::turns && !Cfg::dbuf, "the wide kernel: no TURNS, DBUF");
  static constexpr int STATS_BYTES = 2 * BM * 4;
  static constexpr int PANELS = 1;  // D = 64: one 64-column panel per K, V, Q, dO row
  static constexpr int THREADS = (NC + 1) * 128;
  static_assert(BN == 64 * NC && BM == 64 * NC, "each consumer owns 64 keys and 64 dQ rows");
  static constexpr int KV_BYTES = BN * D * 2;
  static constexpr int Q_BYTES = BM * D * 2;          // Q or dO tile, one [BM][64] panel
  static constexpr int DS_PANEL = BN * 128;           // [BN keys][64 queries]
  static constexpr int DS_BYTES = (BM / 64) * DS_PANEL;
  static constexpr int DQ_STAGE_BYTES = 64 * D * 4;   // per consumer: its 64 rows, fp32
  static constexpr int DQ_BOXES = 2;                  // as in Bwd: consumer c owns rows [64c, 64c + 64)
  __device__ static constexpr int dq_col(int, int bx) { return 32 * bx; }
  __device__ static constexpr int dq_row(int c) { return 64 * c; }
  static constexpr int DS_BUFS = 2;
  static constexpr int SMEM = 2 * KV_BYTES + 2 * STAGES * Q_BYTES + DS_BUFS * DS_BYTES + NC * DQ_STAGE_BYTES +
                              STAGES * STATS_BYTES + 1024 + 256;
  static_assert(SMEM <= 227 * 1024, "shared memory");
};

template <typename T, class Cfg>
__global__ void __launch_bounds__(BwdWide<T, Cfg>::THREADS, 1)
    attention_bwd_wide_kernel(const __grid_constant__ CUtensorMap qmap, const __grid_constant__ CUtensorMap kmap,
                              const __grid_constant__ CUtensorMap vmap, const __grid_constant__ CUtensorMap domap,
                              const __grid_constant__ CUtensorMap dqmap, const __grid_constant__ DkvMaps dkv,
                              const BwdParams p) {
  using K_ = BwdWide<T, Cfg>;
  constexpr int BM = K_::BM, BN = K_::BN, NC = K_::NC, STAGES = K_::STAGES;
  extern __shared__ uint8_t smem_raw[];
  // K, V: [BN][64]; Q, dO: [STAGES][BM][64]; dS^T: [2 buffers][BM / 64 query panels][BN][64];
  // dQ staging: [NC][2 column halves][64 rows][32 fp32], 128-byte swizzle
  const BwdSmem<K_> sm(smem_raw);
  uint8_t *sK = sm.sK, *sV = sm.sV, *sQ = sm.sQ, *sdO = sm.sdO, *sdS = sm.sdS;
  tk::semaphore *kv_full = sm.kv_full, *q_full = sm.q_full, *q_empty = sm.q_empty;

  int b, hk, kb;
  decode_bwd_block(p, b, hk, kb);
  const int n0 = kb * BN;
  // Causal (top-left): rows below n0 see none of this block; BM == BN, so the
  // first tile is the diagonal one.
  const int mb_start = p.causal ? n0 / BM : 0;
  const int nqb = (p.N + BM - 1) / BM;
  const int steps_per_head = max(0, nqb - mb_start);
  const int steps = steps_per_head * p.group;

  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  sm.init();

  if (wg == 0) {  // ---------------- producer ----------------
    const BwdBlock blk{b, hk, n0, mb_start, steps_per_head, steps};
    bwd_producer<K_>(sm, p, blk, &qmap, &kmap, &vmap, &domap, tid);
    if constexpr (K_::PRODQ) {
      if (tid == 32) bwd_dq_reducer<K_>(sm, p, blk, &dqmap);
    }
    return;
  }

  // ---------------- consumers ----------------
  tk::warpgroup::increase_registers<240>();
  const int c = tk::warp_uniform(wg - 1);  // uniform: the descriptors below stay in uniform registers
  const int warp = tid / 32, lane = tid % 32;
  const int row_in = 16 * warp + lane / 4;
  const int col_in = 2 * (lane % 4);
  const int j0 = n0 + 64 * c + row_in;  // this thread's keys: j0 and j0 + 8
  const uint32_t sK_u = tk::smem_addr(sK), sV_u = tk::smem_addr(sV), sQ_u = tk::smem_addr(sQ), sdO_u = tk::smem_addr(sdO);
  const uint32_t sdS_u = tk::smem_addr(sdS);

  float dk[32], dv[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.f;

  tk::wait(*kv_full, 0);
  int g = 0, mb = mb_start;  // (head in the group, q block) of step it
  for (int it = 0; it < steps; ++it, mb = mb + 1 < nqb ? mb + 1 : (++g, mb_start)) {  // no division per step
    const int bh = (b * p.Hkv + hk) * p.group + g;  // query head index b*Hq + h
    const int i0 = mb * BM;
    const int s = it % STAGES;
    const uint32_t qs = sQ_u + s * K_::Q_BYTES, dos = sdO_u + s * K_::Q_BYTES;
    const float* lse_row = sm.sStats + s * 2 * BM;  // the step's lse2 and delta, in the ring stage
    const float* del_row = lse_row + BM;

    // S^T = K_c Q^T and dP^T = V_c dO^T: 64 keys x 128 queries each.
    float st[BM / 2], dpt[BM / 2];
    tk::wait(q_full[s], (it / STAGES) & 1);
    const uint64_t ka = desc_kmajor(sK_u + c * 64 * 128), qb = desc_kmajor(qs);
    const uint64_t va = desc_kmajor(sV_u + c * 64 * 128), ob = desc_kmajor(dos);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      tk::warpgroup::mma_ss<T, 0, 0>(st, kmajor_step(ka, kk, BN), kmajor_step(qb, kk, BM), kk > 0);
    tk::warpgroup::mma_commit();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      tk::warpgroup::mma_ss<T, 0, 0>(dpt, kmajor_step(va, kk, BN), kmajor_step(ob, kk, BM), kk > 0);
    tk::warpgroup::mma_commit();
    tk::warpgroup::mma_async_wait<1>();
    tk::warpgroup::hold(st);
    const bool need_mask = (p.causal && i0 < n0 + 64 * c + 63) || n0 + 64 * c + 64 > p.M;
    bwd_probs<BM>(st, lse_row, p, i0, j0, col_in, need_mask);
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(dpt);
    // dS^T = P^T (dP^T - delta) in place, then dV += P^T dO and dK += dS^T Q
    // (dO and Q are [query][d]: MN-major B operands). Both A operands are
    // packed before the MMAs are issued: issuing dV first (to overlap the dS^T
    // math, as the 64-row kernel does) keeps the fp32 P^T live as well, and
    // ptxas then runs out of registers and serializes every wgmma (C7512).
    uint32_t pa[BM / 16][4], dsa[BM / 16][4];
    StatsPairs del{del_row, col_in};
#pragma unroll
    for (int ch = 0; ch < BM / 8; ++ch) {
      const float2 dl = del(ch);
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[4 * ch + e] = st[4 * ch + e] * (dpt[4 * ch + e] - ((e & 1) ? dl.y : dl.x));
    }
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      acc_to_a<T>(pa[kk], st, kk);
      acc_to_a<T>(dsa[kk], dpt, kk);
    }
    const uint64_t dob = desc_mnmajor(dos, BM * 128), qsb = desc_mnmajor(qs, BM * 128);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) tk::warpgroup::mma_rs<T, 1>(dv, pa[kk], mnmajor_step(dob, kk), 1);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) tk::warpgroup::mma_rs<T, 1>(dk, dsa[kk], mnmajor_step(qsb, kk), 1);
    tk::warpgroup::mma_commit();

    // dS^T to buffer it % 2 ([query panel][key][query]). The buffer was last
    // read by step it - 2's dQ; both consumers finished that before arriving
    // at step it - 1's barrier, which this thread has passed.
    store_ds<BM, K_::DS_PANEL>(sdS_u + (it & 1) * K_::DS_BYTES, dsa, 64 * c + 16 * warp, lane);
    tk::fence_async_shared();
    tk::named_sync(1, NC * 128);

    // dQ rows [64c, 64c+64) of the tile = dS K over all BN keys: A = dS
    // (query-major panel c of dS^T), B = K (MN-major).
    float dq[32];
    const uint32_t ds_u = sdS_u + (it & 1) * K_::DS_BYTES + c * K_::DS_PANEL;
    const uint64_t dsa0 = desc_mnmajor(ds_u, K_::DS_PANEL), kb0 = desc_mnmajor(sK_u, BN * 128);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      tk::warpgroup::mma_ss<T, 1, 1>(dq, mnmajor_step(dsa0, kk), mnmajor_step(kb0, kk), kk > 0);
    tk::warpgroup::mma_commit();
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(dq);
    tk::warpgroup::hold(dk);
    tk::warpgroup::hold(dv);
    tk::warpgroup::hold(pa);
    tk::warpgroup::hold(dsa);
    __syncwarp();
    if (lane == 0) tk::arrive(q_empty[s]);

    hand_over_dq<K_, 64>(sm, &dqmap, dq, it, c, tid, i0, bh);
  }
  if (tid == 0) tk::tma::store_wait();

  store_dkdv<T, 64, K_>(sm, p, dkv, dk, dv, b, hk, n0, c, tid, j0, col_in);
}

template <typename T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }

// Per padded (bh, row): delta = rowsum(dO * O), lse2 = lse * log2e, and the
// row of dq_accum zeroed (one pass instead of a separate fill). D / 8 lanes
// per row with 16-byte loads (o and dO rows are 16-byte aligned: tma_ready in
// the binding). Rows in [N, Npad) get delta 0 and lse2 +inf so the main
// kernel needs no bounds. delta and lse2 go to their stats_slot (StatsPairs).
template <typename T, int D>
__global__ void attention_bwd_pre_kernel(View4 dout, View4 o, const float* lse, float* lse2, float* delta,
                                         float* dq_accum, int Npad) {
  constexpr int LPR = D / 8;  // lanes per row: a power of two dividing 32
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t w = t / LPR;
  const int l = static_cast<int>(t % LPR);
  const int64_t BH = o.B * o.H;
  const bool live = w < BH * Npad;  // no early return: the row's lanes shuffle below
  float acc = 0.f;
  int row = 0;
  if (live) {
    float4* dqrow = reinterpret_cast<float4*>(dq_accum + w * D);
#pragma unroll
    for (int i = l; i < D / 4; i += LPR) dqrow[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    const int64_t bh = w / Npad;
    row = static_cast<int>(w % Npad);
    if (row < o.S) {
      const int64_t b = bh / o.H, h = bh % o.H;
      const uint4 ov = *reinterpret_cast<const uint4*>(static_cast<const T*>(o.ptr) + b * o.sb + h * o.sh +
                                                       row * o.ss + 8 * l);
      const uint4 dv = *reinterpret_cast<const uint4*>(static_cast<const T*>(dout.ptr) + b * dout.sb +
                                                       h * dout.sh + row * dout.ss + 8 * l);
      const T* oe = reinterpret_cast<const T*>(&ov);
      const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += to_f(oe[e]) * to_f(de[e]);
    }
  }
#pragma unroll
  for (int off = LPR / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (live && l == 0) {
    const int64_t bh = w / Npad;
    const int64_t slot = w - row + stats_slot(row);  // Npad is a multiple of 32
    delta[slot] = row < o.S ? acc : 0.f;
    lse2[slot] = row < o.S ? lse[bh * o.S + row] * 1.4426950408889634f : INFINITY;
  }
}

// dq = dq_accum * scale, cast, into dq's strides; 8 elements per thread (D is a multiple of 8, so a group never
// crosses a row, and the binding's dq has 16-byte rows). Each 8-column group of dq_accum holds its even columns,
// then its odd ones (stage_dq by stmatrix).
template <typename T, int D>
__global__ void attention_bwd_post_kernel(const float* dq_accum, View4 dq, int Npad, float scale) {
  const int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  const int64_t N = dq.S, BH = dq.B * dq.H;
  if (idx >= BH * N * D) return;
  const int64_t bh = idx / (N * D);
  const int64_t rem = idx - bh * N * D;
  const float4* src = reinterpret_cast<const float4*>(dq_accum + bh * Npad * D + rem);
  float4 a = src[0], c = src[1];
  {  // a = columns 0 2 4 6, c = 1 3 5 7
    const float4 ev = a, od = c;
    a = make_float4(ev.x, od.x, ev.y, od.y);
    c = make_float4(ev.z, od.z, ev.w, od.w);
  }
  uint4 out;
  out.x = pack2<T>(a.x * scale, a.y * scale);
  out.y = pack2<T>(a.z * scale, a.w * scale);
  out.z = pack2<T>(c.x * scale, c.y * scale);
  out.w = pack2<T>(c.z * scale, c.w * scale);
  const int64_t b = bh / dq.H, h = bh - b * dq.H, n = rem / D;
  T* row = static_cast<T*>(const_cast<void*>(dq.ptr)) + b * dq.sb + h * dq.sh + n * dq.ss;
  *reinterpret_cast<uint4*>(row + (rem - n * D)) = out;
}

// Rows of the padded lse2 / delta / dq_accum: a multiple of the q tile.
int64_t bwd_npad(int64_t N, int bm) { return (N + bm - 1) / bm * bm; }

// KV heads per section of the block order. sections = false: 1, head by head (all key blocks of a head, then
// the next head). Else about 4 waves of blocks, so a section's heavy blocks (causal) start before its light
// ones fill the tail, capped so the section's Q, dO and fp32 dq_accum (group * N * D * 8 bytes a kv head) take
// at most 32 MiB of the L2. benchmarks/schedule_model.py --backward: makespan 1.00-1.03x the ideal where head
// by head gives 1.14-1.58x (causal at training batch sizes).
int bwd_section(bool sections, int num_sms, int nk, int64_t BH, int64_t group, int64_t N, int64_t D) {
  if (!sections) return 1;
  return section_heads(BH, nk, 4LL * num_sms, (32LL << 20) / std::max<int64_t>(1, group * N * D * 8));
}

template <typename T, int D, typename Cfg>
const char* launch_bwd(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v, const View4& o,
                       const float* lse, const View4& dq, const View4& dk, const View4& dv, float* dq_accum,
                       float* lse2, float* delta, bool causal, float scale, int num_sms, bool sections,
                       cudaStream_t stream) {
  constexpr bool WIDE = Cfg::kind == Kind::Wide;
  static_assert(!WIDE || D == 64, "the wide kernel is D = 64");
  constexpr int BM = Cfg::BM;
  const int Npad = static_cast<int>(bwd_npad(q.S, BM));
  const int64_t BH = q.B * q.H;
  {
    const int64_t lanes = BH * Npad * (D / 8);
    const int threads = 256;
    attention_bwd_pre_kernel<T, D><<<static_cast<unsigned>((lanes + threads - 1) / threads), threads, 0, stream>>>(
        dout, o, lse, lse2, delta, dq_accum, Npad);
  }
  CUtensorMap qm, km, vm, dom;
  if (const char* e = make_map(&qm, dt, q, BM)) return e;
  if (const char* e = make_map(&km, dt, k, BWD_BN)) return e;
  if (const char* e = make_map(&vm, dt, v, BWD_BN)) return e;
  if (const char* e = make_map(&dom, dt, dout, BM)) return e;
  CUtensorMap dqm;
  if (const char* e = make_map_f32(&dqm, dq_accum, D, Npad, BH)) return e;
  DkvMaps dkvm{};  // dk, dv: (B, Hkv, M, D) in the binding's strides
  if (const char* e = make_map(&dkvm.dk, dt, dk, 64)) return e;
  if (const char* e = make_map(&dkvm.dv, dt, dv, 64)) return e;
  BwdParams p;
  p.B = q.B;
  p.Hq = q.H;
  p.Hkv = k.H;
  p.N = q.S;
  p.M = k.S;
  p.group = q.H / k.H;
  p.Npad = Npad;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.causal = causal;
  p.lse2 = lse2;
  p.delta = delta;
  p.dq_accum = dq_accum;
  p.nk = static_cast<int>((k.S + BWD_BN - 1) / BWD_BN);
  p.section = bwd_section(sections, num_sms, p.nk, k.B * k.H, p.group, q.S, D);
  int smem, threads;
  void (*kern)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, DkvMaps, BwdParams);
  if constexpr (WIDE) {
    using K_ = BwdWide<T, Cfg>;
    kern = attention_bwd_wide_kernel<T, Cfg>;
    smem = K_::SMEM;
    threads = K_::THREADS;
  } else {
    using K_ = Bwd<T, D, Cfg>;
    kern = attention_bwd_kernel<T, D, Cfg>;
    smem = K_::SMEM;
    threads = K_::THREADS;
  }
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return "cudaFuncSetAttribute failed for the attention backward kernel";
  kern<<<static_cast<unsigned>(p.nk * k.B * k.H), threads, smem, stream>>>(qm, km, vm, dom, dqm, dkvm, p);
  if (cudaGetLastError() != cudaSuccess) return "attention backward launch failed";
  {
    const int64_t groups = BH * q.S * D / 8;
    const int threads = 256;
    attention_bwd_post_kernel<T, D><<<static_cast<unsigned>((groups + threads - 1) / threads), threads, 0, stream>>>(
        dq_accum, dq, Npad, scale);
  }
  return cudaGetLastError() == cudaSuccess ? nullptr : "attention backward post-process launch failed";
}

// The configuration the backward runs, per head dim (measured on the H200 against cuDNN: benchmarks/RESULTS.md):
// at D = 128 the 64-row kernel with dS^T double-buffered and the consumers taking turns, at D = 64 the wide kernel
// (128-row q tiles) with a producer warp issuing the dQ reduce-adds.
template <int D>
struct BwdConfig;
template <>
struct BwdConfig<128> {
  using Cfg = BwdCfg<Kind::Tile64, 2, bwd::DBUF | bwd::TURNS>;
};
template <>
struct BwdConfig<64> {
  using Cfg = BwdCfg<Kind::Wide, 2, bwd::PRODQ>;
};

int bwd_bm(int D) { return D == 64 ? BwdConfig<64>::Cfg::BM : BwdConfig<128>::Cfg::BM; }

}  // namespace

BwdScratch attention_backward_scratch(const View4& q) {
  const int64_t Npad = bwd_npad(q.S, bwd_bm(static_cast<int>(q.D)));
  const int64_t BH = q.B * q.H;
  return {static_cast<size_t>(BH * Npad * q.D * 4), static_cast<size_t>(BH * Npad * 4),
          static_cast<size_t>(BH * Npad * 4)};
}

const char* attention_backward(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                               const View4& o, const float* lse, const View4& dq, const View4& dk, const View4& dv,
                               float* dq_accum, float* lse2, float* delta, bool causal, float scale, int num_sms,
                               cudaStream_t stream) {
  const auto run = [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    // L2 sections of heads, key blocks outermost, under a causal mask (its key blocks differ in cost); head by head
    // without one (its equal blocks are balanced already).
    return launch_bwd<T, D, typename BwdConfig<D>::Cfg>(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum, lse2, delta,
                                                        causal, scale, num_sms, causal, stream);
  };
  using D128 = std::integral_constant<int, 128>;
  using D64 = std::integral_constant<int, 64>;
  if (q.D == 128) return dt == DType::bf16 ? run(__nv_bfloat16{}, D128{}) : run(__half{}, D128{});
  if (q.D == 64) return dt == DType::bf16 ? run(__nv_bfloat16{}, D64{}) : run(__half{}, D64{});
  return "head dim must be 64 or 128";
}

}  // namespace tk_attn
