// Attention forward on Hopper: one producer warpgroup streams K/V tiles with
// TMA through a STAGES-deep ring; NC consumer warpgroups each own 64 query
// rows, compute S = Q K^T and O += P V on wgmma, and keep the online softmax
// (exp2 domain, fp32 max and sum) in registers. Persistent grid; tasks are
// (batch*head, query block) in an L2-friendly, heavy-first order.
//
// This header: the configurations, shared memory, task order and the producer the forward kernels share
// (forward_kernels.cuh: the kernels; forward_launch.cuh: their launch).
#pragma once
#include <climits>
#include <cmath>
#include <type_traits>

#include "attention.h"
#include "tk/grid.cuh"
#include "common.cuh"
#include "dropout.cuh"
#include "tma.cuh"

namespace tk_attn {
namespace {

// One forward configuration: head dim, consumer warpgroups (64 query rows each), key tile and ring stages. The
// consumers run the ping-pong schedule (turn barriers between the warpgroups and intra-warpgroup overlap, see
// attention_fwd_pp_kernel), with O leaving (OSTAGE) through shared memory and a TMA store per 64-column panel (full
// 128-byte lines, clipped at N by the TMA unit; 4-byte stores from registers fill only half of each 32-byte sector and
// hold the warpgroup in the store queue at the end of every task). Registers: the launch grants 65536 / THREADS each;
// setmaxnreg moves the producer's share to the consumers.
// XTASK: a warpgroup issues the next task's first QK^T before it finishes the current task (normalises and stores
// O), so the tensor cores are not idle while both warpgroups do their epilogues. OSTAGE false: O is stored from
// registers, for a head dim whose K/V rings leave no shared memory for the stage.
template <int D_, int NC_, int BN_, int STAGES_, bool XTASK_ = false, bool OSTAGE_ = true>
struct FwdCfg {
  static constexpr int D = D_, NC = NC_, BN = BN_, STAGES = STAGES_;
  static constexpr bool XTASK = XTASK_, OSTAGE = OSTAGE_;
  static_assert(NC == 2 || NC == 3, "2 or 3 consumer warpgroups");
  static constexpr int REG_PROD = NC == 2 ? 24 : 32;
  static constexpr int REG_CONS = NC == 2 ? 240 : 160;
};

template <typename T, typename Cfg>
struct Fwd {
  using C = Cfg;
  static constexpr int D = C::D, NC = C::NC, BN = C::BN, STAGES = C::STAGES;
  static constexpr int BM = 64 * NC;
  static constexpr int PANELS = D / 64;
  static constexpr int THREADS = (NC + 1) * 128;
  static_assert(D == 64 || D == 128 || D == 192 || D == 256, "head dim 64, 128, 192 or 256");
  static_assert(BN % 16 == 0 && BN <= 256, "key tile");
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int KV_BYTES = BN * D * 2;  // one K (or V) tile
  static constexpr int O_BYTES = C::OSTAGE ? BM * D * 2 : 0;  // the O stage
  static constexpr int REST = 2 * STAGES * KV_BYTES + O_BYTES + 1024 /*align*/ + 256 /*barriers*/;
  // Q slots: two where shared memory holds them (D <= 128), so the producer loads the next task's Q while this one
  // runs and a task with few key blocks (a small window, a short sequence) does not wait for its Q at the start.
  static constexpr int QBUF = 2 * Q_BYTES + REST <= 232448 ? 2 : 1;
  static constexpr int SMEM = QBUF * Q_BYTES + REST;
  static_assert(SMEM <= 232448, "shared memory per block");
  static_assert(2 * QBUF + 4 * STAGES <= 31, "barriers fit their 256 bytes, less the task slots");
  static constexpr int S_REGS = BN / 2;  // 64 x BN fp32 accumulator per thread
  static constexpr int O_REGS = D / 2;
};

// Shared memory of a forward block: the Q slots, the K and V rings (64-column panels, 128-byte swizzle), the O stage
// and the mbarriers. K and V stages are released separately. Task ti's Q is in slot q_slot(ti) with its phase
// q_phase(ti) on q_full / q_empty of that slot.
template <class K_>
struct FwdSmem {
  uint8_t *sQ, *sK, *sV, *sO;  // [QBUF][PANELS][BM][64], [STAGES][PANELS][BN][64] twice, [PANELS][BM][64] (OSTAGE)
  tk::semaphore *q_full, *q_empty, *k_full, *v_full, *k_empty, *v_empty;  // q_*: one per Q slot
  // dynamic schedule: the task the producer hands the consumers with a slot's q_full (the barriers' last 8 bytes)
  __device__ __forceinline__ volatile int* task(int slot) const {
    return reinterpret_cast<volatile int*>(q_full + 31) + slot;
  }
  static __device__ __forceinline__ int q_slot(int ti) { return ti % K_::QBUF; }
  static __device__ __forceinline__ int q_phase(int ti) { return (ti / K_::QBUF) & 1; }
  __device__ __forceinline__ explicit FwdSmem(uint8_t* raw) {
    sQ = tk::align_shared<1024>(raw);
    sK = sQ + K_::QBUF * K_::Q_BYTES;
    sV = sK + K_::STAGES * K_::KV_BYTES;
    sO = sV + K_::STAGES * K_::KV_BYTES;
    q_full = reinterpret_cast<tk::semaphore*>(sO + K_::O_BYTES);
    q_empty = q_full + K_::QBUF;
    k_full = q_empty + K_::QBUF;
    v_full = k_full + K_::STAGES;
    k_empty = v_full + K_::STAGES;
    v_empty = k_empty + K_::STAGES;
  }
  // Thread 0 initialises the barriers; then the block syncs.
  __device__ __forceinline__ void init() const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < K_::QBUF; ++s) {
        tk::init_semaphore(q_full[s], 1);
        tk::init_semaphore(q_empty[s], K_::NC * 4);  // one arrival per consumer warp
      }
      for (int s = 0; s < K_::STAGES; ++s) {
        tk::init_semaphore(k_full[s], 1);
        tk::init_semaphore(v_full[s], 1);
        tk::init_semaphore(k_empty[s], K_::NC * 4);
        tk::init_semaphore(v_empty[s], K_::NC * 4);
      }
      tk::fence_semaphore_init();
    }
    __syncthreads();
  }
};

struct FwdParams {
  int B, Hq, Hkv, N, M, group;
  int d;  // the head dim of q, k, v and o: D or less (TMA zero-fills the columns past it and never stores them)
  int nq, tasks, section;  // query blocks per head, total tasks, heads per L2 section
  float scale_log2;        // the exponent's factor: scale * log2 e, or log2 e on softcapped scores
  float cap_in, cap_out;   // softcap: s = cap_out * tanh(cap_in * q k^T) (cap_in = scale / cap, cap_out = cap)
  bool causal;
  int window;  // causal sliding window: key j hidden from query i when i - j >= window (INT_MAX: none)
  const int* row_keys;  // (B, N, 2): the keys [x, y] each query may see (Scores::row_keys); null: all
  Dropout drop;         // the DROP kernels' stream (dropout.cuh)
  void* o;
  float* lse;
  int* next_task;  // dynamic schedule: the task counter, zero at launch (static schedule: unused)
};

// The keys [x, y] row r of batch entry b may see by Scores::row_keys, clamped to the keys (rows past N, which are
// never stored: row N - 1's). Nondecreasing in x and y along the rows.
__device__ __forceinline__ int2 row_bounds(const FwdParams& p, int b, int r) {
  const int2 v = interval(p.row_keys, b, p.N, min(r, p.N - 1), make_int2(0, p.M - 1));
  return make_int2(max(v.x, 0), min(v.y, p.M - 1));
}

// The keys [x, y] (inclusive; empty when y < x) row r of batch entry b sees: its row_bounds, up to the row under a
// causal mask, from its window's first key.
__device__ __forceinline__ int2 row_keys(const FwdParams& p, int b, int r) {
  const int2 v = row_bounds(p, b, r);
  return make_int2(max(v.x, r - p.window + 1), p.causal ? min(v.y, r) : v.y);
}

// The key blocks [lo, hi) that query rows [m0, m0 + BM) of batch entry b see: from the first row's first key (or its
// window's), up to the last row's last key (and the tile's last row under a causal mask; rows past N are never
// stored). lo < hi: a tile whose rows see no key streams one block, masked whole.
template <int BN>
__device__ __forceinline__ int2 key_blocks(const FwdParams& p, int b, int m0, int BM) {
  const int first = row_bounds(p, b, m0).x, last = row_bounds(p, b, min(m0 + BM, p.N) - 1).y;
  const int end = p.causal ? min(last + 1, min(p.N, m0 + BM)) : last + 1;
  const int hi = max(1, (end + BN - 1) / BN);
  return make_int2(min(max(first, m0 - p.window + 1) / BN, hi - 1), hi);
}

// Task t -> (batch*head, query block), by section_decode: heads in L2 sections, query blocks outermost in a
// section, and for causal last-first, so the heaviest blocks start first and the light ones fill the tail.
__device__ __forceinline__ void decode_task(const FwdParams& p, int t, int& bh, int& qb) {
  int rank;
  section_decode(t, p.B * p.Hq, p.nq, p.section, bh, rank);
  qb = p.causal ? p.nq - 1 - rank : rank;
}

// Which tasks a block runs. Static: blockIdx.x, + gridDim.x, ... Its shares end unevenly when there are few
// tasks per SM or the section size resonates with the grid (a model of the schedule put the slowest block
// 1.2-1.4x over the mean at training batch sizes). DYN (causal, where task lengths differ): the producer takes its
// next task from a global counter once it has issued the current one's loads, so blocks that finish early take
// more; it hands each task to the consumers in shared memory, published by the arrive on q_full, and p.tasks
// ends the block. The steps are written `t += DYN ? step : gridDim.x`, as the static loops always were: a helper
// returning the static step changed the register allocation of the static ping-pong kernels.
// The dynamic producer's step from task t to its next one.
__device__ __forceinline__ unsigned dynamic_step(const FwdParams& p, int t) {
  return unsigned(int(gridDim.x) + atomicAdd(p.next_task, 1) - t);
}
// The dynamic consumers' step from task t to the next one, task ti of the block, which the producer hands over with
// its Q slot's q_full (the first task is blockIdx.x either way).
template <class Smem>
__device__ __forceinline__ unsigned consumer_step(const Smem& sm, int t, int ti) {
  tk::wait(sm.q_full[Smem::q_slot(ti)], Smem::q_phase(ti));
  return unsigned(*sm.task(Smem::q_slot(ti)) - t);
}

// The producer warpgroup of the forward kernels. Thread 0 walks the block's tasks in the consumers' order, loads each
// task's Q tile and streams its K/V tiles through the rings. K and V stages are released separately and K_{j+1} goes
// before V_j, as the consumers' round j+1 waits for both.
template <class K_, bool DYN>
__device__ __forceinline__ void fwd_producer(const FwdSmem<K_>& sm, const FwdParams& p, const CUtensorMap* qmap,
                                             const CUtensorMap* kmap, const CUtensorMap* vmap, int tid) {
  constexpr int BN = K_::BN, STAGES = K_::STAGES, BM = K_::BM, PANELS = K_::PANELS;
  tk::warpgroup::decrease_registers<K_::C::REG_PROD>();
  if (tid != 0) return;
  tk::tma::prefetch_map(qmap);
  tk::tma::prefetch_map(kmap);
  tk::tma::prefetch_map(vmap);
  int it = 0, ti = 0;  // K/V blocks and tasks so far: they give the ring's and Q's barrier phases
  for (int t = blockIdx.x; t < p.tasks; t += DYN ? dynamic_step(p, t) : gridDim.x, ++ti) {
    int bh, qb;
    decode_task(p, t, bh, qb);
    const int b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
    const int m0 = qb * BM;
    const int qs = sm.q_slot(ti);
    tk::wait(sm.q_empty[qs], sm.q_phase(ti) ^ 1);
    if constexpr (DYN) *sm.task(qs) = t;
    tk::expect_bytes(sm.q_full[qs], K_::Q_BYTES);
    uint8_t* sQ = sm.sQ + qs * K_::Q_BYTES;
#pragma unroll
    for (int pn = 0; pn < PANELS; ++pn) tk::tma::load_async(sQ + pn * BM * 128, qmap, sm.q_full[qs], pn * 64, m0, h, b);
    const int2 kb = key_blocks<BN>(p, b, m0, BM);
    const int nblk = kb.y - kb.x;
    // Key block kb.x + j of K or V into stage s.
    auto issue = [&](tk::semaphore* full, uint8_t* ring, const CUtensorMap* map, int s, int j) {
      tk::expect_bytes(full[s], K_::KV_BYTES);
#pragma unroll
      for (int pn = 0; pn < PANELS; ++pn)
        tk::tma::load_async(ring + s * K_::KV_BYTES + pn * BN * 128, map, full[s], pn * 64, (kb.x + j) * BN, hk, b);
    };
    auto load = [&](tk::semaphore* empty, tk::semaphore* full, uint8_t* ring, const CUtensorMap* map, int pos, int j) {
      const int s = pos % STAGES;
      tk::wait(empty[s], ((pos / STAGES) & 1) ^ 1);
      issue(full, ring, map, s, j);
    };
    load(sm.k_empty, sm.k_full, sm.sK, kmap, it, 0);
    for (int j = 0; j < nblk; ++j) {
      if (j + 1 < nblk) load(sm.k_empty, sm.k_full, sm.sK, kmap, it + j + 1, j + 1);
      load(sm.v_empty, sm.v_full, sm.sV, vmap, it + j, j);
    }
    it += nblk;
  }
  if constexpr (DYN) {  // no task left: once the consumers are done with the last Q, say so
    const int qs = sm.q_slot(ti);
    tk::wait(sm.q_empty[qs], sm.q_phase(ti) ^ 1);
    *sm.task(qs) = p.tasks;
    tk::arrive(sm.q_full[qs]);
  }
}

}  // namespace
}  // namespace tk_attn
