// The attention backward's main kernels: attention_bwd_kernel (64-row q tiles, D = 128) and
// attention_bwd_wide_kernel (128-row q tiles, D = 64), on the pieces of backward.cuh.
#pragma once
#include "backward.cuh"

namespace tk_attn {
namespace {

// DROP: dropout (dropout.cuh); dV takes the kept probabilities, dS the kept part of dP^T (bwd_ds), and dV is scaled
// by 1 / (1 - p) once, at its store.
template <typename T, int D, class Cfg, bool CAP, bool DROP>
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

  const BwdBlock blk = bwd_block<BM, BN>(p);
  const int b = blk.b, hk = blk.hk, n0 = blk.n0, mb_start = blk.mb_start, mb_end = blk.mb_end, steps = blk.steps;

  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  sm.init();

  if (wg == 0) {  // ---------------- producer ----------------
    bwd_producer_warpgroup<K_>(sm, p, blk, &qmap, &kmap, &vmap, &domap, &dqmap, tid);
    return;
  }

  // ---------------- consumers ----------------
  tk::warpgroup::increase_registers<240>();
  const int c = tk::warp_uniform(wg - 1);  // uniform: the descriptors below stay in uniform registers
  const int warp = tid / 32, lane = tid % 32;
  const int row_in = 16 * warp + lane / 4;
  const int col_in = 2 * (lane % 4);
  const int j0 = n0 + 64 * c + row_in;  // this thread's keys: j0 and j0 + 8
  const KeyMask km(p, b, n0 + 64 * c, j0);
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
    bwd_probs<BM, CAP>(st, lse_row, p, km, i0, j0, col_in, bwd_need_mask<BM>(p, km, i0, n0 + 64 * c));
    uint64_t keep = 0;
    if constexpr (DROP) keep = p.drop.keep_tile<true, BM>(bh, j0, i0 + col_in);
    uint32_t pa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      if constexpr (DROP)
        acc_to_a_kept<T>(pa[kk], st, kk, uint32_t(keep >> (8 * kk)));
      else
        acc_to_a<T>(pa[kk], st, kk);
    }
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(dpt);
    Turn::wait(c);
    // dV += P^T dO (dO is [query][d]: MN-major B operand)
    const uint64_t dob = desc_mnmajor(dos, BM * 128);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) tk::warpgroup::mma_rs<T, 1>(dv, pa[kk], mnmajor_step(dob, kk), 1);
    tk::warpgroup::mma_commit();
    bwd_ds<BM, CAP, DROP>(dpt, st, lse_row, del_row, p, col_in, keep);
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
    mb_it = mb_it + 1 < mb_end ? mb_it + 1 : (++g_it, mb_start);
  };
  if (c == NC - 1) Turn::pass(c);  // consumer 0 takes the first turn
  for (int it = 0; it < steps; ++it) step(it);
  if (c == 0) Turn::wait(c);  // the last consumer's final hand-over
  if (tid == 0) tk::tma::store_wait();

  store_dkdv<T, D, K_>(sm, p, dkv, dk, dv, b, hk, n0 + 64 * c, 0, c, tid, row_in, col_in, DROP ? p.drop.scale : 1.f);
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
  static constexpr int EMPTY_ARRIVALS = NC * 4;
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

template <typename T, class Cfg, bool CAP, bool DROP>
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

  const BwdBlock blk = bwd_block<BM, BN>(p);  // BM == BN: a causal block's first tile is the diagonal one
  const int b = blk.b, hk = blk.hk, n0 = blk.n0, mb_start = blk.mb_start, mb_end = blk.mb_end, steps = blk.steps;

  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  sm.init();

  if (wg == 0) {  // ---------------- producer ----------------
    bwd_producer_warpgroup<K_>(sm, p, blk, &qmap, &kmap, &vmap, &domap, &dqmap, tid);
    return;
  }

  // ---------------- consumers ----------------
  tk::warpgroup::increase_registers<240>();
  const int c = tk::warp_uniform(wg - 1);  // uniform: the descriptors below stay in uniform registers
  const int warp = tid / 32, lane = tid % 32;
  const int row_in = 16 * warp + lane / 4;
  const int col_in = 2 * (lane % 4);
  const int j0 = n0 + 64 * c + row_in;  // this thread's keys: j0 and j0 + 8
  const KeyMask km(p, b, n0 + 64 * c, j0);
  const uint32_t sK_u = tk::smem_addr(sK), sV_u = tk::smem_addr(sV), sQ_u = tk::smem_addr(sQ), sdO_u = tk::smem_addr(sdO);
  const uint32_t sdS_u = tk::smem_addr(sdS);

  float dk[32], dv[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.f;

  tk::wait(*kv_full, 0);
  int g = 0, mb = mb_start;  // (head in the group, q block) of step it
  for (int it = 0; it < steps; ++it, mb = mb + 1 < mb_end ? mb + 1 : (++g, mb_start)) {  // no division per step
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
    bwd_probs<BM, CAP>(st, lse_row, p, km, i0, j0, col_in, bwd_need_mask<BM>(p, km, i0, n0 + 64 * c));
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(dpt);
    // dS^T = P^T (dP^T - delta) in place, then dV += P^T dO and dK += dS^T Q
    // (dO and Q are [query][d]: MN-major B operands). Both A operands are
    // packed before the MMAs are issued: issuing dV first (to overlap the dS^T
    // math, as the 64-row kernel does) keeps the fp32 P^T live as well, and
    // ptxas then runs out of registers and serializes every wgmma (C7512).
    uint32_t pa[BM / 16][4], dsa[BM / 16][4];
    uint64_t keep = 0;
    if constexpr (DROP) keep = p.drop.keep_tile<true, BM>(bh, j0, i0 + col_in);
    bwd_ds<BM, CAP, DROP>(dpt, st, lse_row, del_row, p, col_in, keep);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      if constexpr (DROP)
        acc_to_a_kept<T>(pa[kk], st, kk, uint32_t(keep >> (8 * kk)));
      else
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

  store_dkdv<T, 64, K_>(sm, p, dkv, dk, dv, b, hk, n0 + 64 * c, 0, c, tid, row_in, col_in, DROP ? p.drop.scale : 1.f);
}

}  // namespace
}  // namespace tk_attn
