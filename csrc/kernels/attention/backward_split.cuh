// The D = 256 attention backward: attention_bwd_split_kernel, on the pieces of backward.cuh.
//
// At D = 256 a consumer that owns keys as the 64- and 128-row kernels do would keep 64 keys x 256 columns of dK and
// of dV in registers (256 a thread). Here one CTA owns 64 keys, K and V resident, and its two consumers split the
// work of each streamed 64-row (Q, dO) tile two ways:
//   consumer c computes S^T and dP^T for query columns [32c, 32c + 32) (m64n32, contracting over all 256 columns),
//   P^T and dS^T for those columns, and writes them to shared memory (one barrier for both consumers);
//   it then owns head-dim columns [128c, 128c + 128) of dV += P^T dO, dK += dS^T Q and dQ = dS K (64 registers
//   each), all three with both operands in shared memory.
// Shared memory: K, V 32 KB each, a two-stage ring of (Q, dO) 64 KB a stage, P^T and dS^T double-buffered (8 KB
// each). No room is left to stage dQ, so it goes through the step's own ring stage: once consumer c's dV and dK
// have read its Q and dO panels (2c, 2c + 1: no one else reads them after the barrier), it stages its fp32 dQ
// block there, one thread issues the reduce-adds into dq_accum and releases the stage when they have read it.
#pragma once
#include "backward.cuh"

namespace tk_attn {
namespace {

template <typename T, class Cfg>
struct BwdSplit {
  static constexpr int D = 256, BM = 64, BN = 64, NC = 2, STAGES = Cfg::stages;
  static_assert(Cfg::kind == Kind::Split && Cfg::BM == BM && Cfg::BN == BN && NC == 2, "the split kernel's shape");
  static constexpr bool PRODQ = false;
  static constexpr int QC = BM / NC;  // query columns of S^T and dP^T per consumer
  static constexpr int DC = D / NC;   // head-dim columns of dV, dK and dQ per consumer
  static constexpr int STATS_BYTES = 2 * BM * 4;
  static constexpr int EMPTY_ARRIVALS = NC;  // one thread per consumer, after its dQ reduce-adds read the stage
  static constexpr int PANELS = D / 64;
  static constexpr int THREADS = (NC + 1) * 128;
  static constexpr int KV_BYTES = BN * D * 2;
  static constexpr int Q_BYTES = BM * D * 2;      // Q or dO tile, [PANELS][BM][64]
  static constexpr int PT_BYTES = BN * BM * 2;    // P^T or dS^T, [BN keys][BM queries]
  static constexpr int DS_PANEL = BN * 128;
  static constexpr int DS_BUFS = 2;
  static constexpr int DS_BYTES = 2 * PT_BYTES;   // a buffer: P^T, then dS^T
  static constexpr int DQ_STAGE_BYTES = 0;        // dQ is staged in the ring (above)
  static constexpr int DQ_BOXES = DC / 32;        // boxes of 32 fp32 columns x 64 rows, 8 KB: two per panel pair
  static constexpr int SMEM = 2 * KV_BYTES + 2 * STAGES * Q_BYTES + DS_BUFS * DS_BYTES + STAGES * STATS_BYTES +
                              1024 + 256;
  static_assert(SMEM <= 227 * 1024, "shared memory");
  static_assert(DC * 64 * 4 == 2 * 2 * BM * 128, "dQ's block fills the consumer's two Q and two dO panels");
};

template <typename T, class Cfg, bool CAP>
__global__ void __launch_bounds__(BwdSplit<T, Cfg>::THREADS, 1)
    attention_bwd_split_kernel(const __grid_constant__ CUtensorMap qmap, const __grid_constant__ CUtensorMap kmap,
                               const __grid_constant__ CUtensorMap vmap, const __grid_constant__ CUtensorMap domap,
                               const __grid_constant__ CUtensorMap dqmap, const __grid_constant__ DkvMaps dkv,
                               const BwdParams p) {
  using K_ = BwdSplit<T, Cfg>;
  constexpr int BM = K_::BM, BN = K_::BN, NC = K_::NC, STAGES = K_::STAGES, QC = K_::QC, DC = K_::DC;
  extern __shared__ uint8_t smem_raw[];
  const BwdSmem<K_> sm(smem_raw);
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
  const int c = tk::warp_uniform(wg - 1);
  const int warp = tid / 32, lane = tid % 32;
  const int row_in = 16 * warp + lane / 4;
  const int col_in = 2 * (lane % 4);
  const int j0 = n0 + row_in;  // this thread's keys in S^T: j0 and j0 + 8 (both consumers see all 64 keys)
  const KeyMask km(p, b, n0, j0);
  const uint32_t sK_u = tk::smem_addr(sm.sK), sV_u = tk::smem_addr(sm.sV), sQ_u = tk::smem_addr(sm.sQ);
  const uint32_t sdO_u = tk::smem_addr(sm.sdO), sdS_u = tk::smem_addr(sm.sdS);
  const uint64_t ka = desc_kmajor(sK_u), va = desc_kmajor(sV_u);
  const uint64_t kb = desc_mnmajor(sK_u + 2 * c * BN * 128, BN * 128);  // K's columns [128c, 128c + 128) for dQ

  float dk[DC / 2], dv[DC / 2];
#pragma unroll
  for (int i = 0; i < DC / 2; ++i) dk[i] = dv[i] = 0.f;

  tk::wait(*sm.kv_full, 0);
  int g = 0, mb = mb_start;  // (head in the group, q block) of step it
  for (int it = 0; it < steps; ++it, mb = mb + 1 < mb_end ? mb + 1 : (++g, mb_start)) {
    const int bh = (b * p.Hkv + hk) * p.group + g;
    const int i0 = mb * BM, iq = i0 + QC * c;  // the tile's first query, this consumer's first
    const int s = it % STAGES;
    const uint32_t qs = sQ_u + s * K_::Q_BYTES, dos = sdO_u + s * K_::Q_BYTES;
    const float* lse_row = sm.sStats + s * 2 * BM + QC * c;  // stats_slot keeps groups of 32 rows in place
    const float* del_row = sm.sStats + s * 2 * BM + BM + QC * c;

    // S^T = K Q_c^T and dP^T = V dO_c^T: 64 keys x this consumer's 32 queries, over all 256 columns.
    float st[QC / 2], dpt[QC / 2];
    tk::wait(sm.q_full[s], (it / STAGES) & 1);
    const uint64_t qb = desc_kmajor(qs + QC * c * 128), ob = desc_kmajor(dos + QC * c * 128);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < K_::D / 16; ++kk)
      tk::warpgroup::mma_ss<T, 0, 0>(st, kmajor_step(ka, kk, BN), kmajor_step(qb, kk, BM), kk > 0);
    tk::warpgroup::mma_commit();
#pragma unroll
    for (int kk = 0; kk < K_::D / 16; ++kk)
      tk::warpgroup::mma_ss<T, 0, 0>(dpt, kmajor_step(va, kk, BN), kmajor_step(ob, kk, BM), kk > 0);
    tk::warpgroup::mma_commit();
    tk::warpgroup::mma_async_wait<1>();
    tk::warpgroup::hold(st);
    bwd_probs<QC, CAP>(st, lse_row, p, km, iq, j0, col_in, bwd_need_mask<QC>(p, km, iq, n0));
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(dpt);
    bwd_ds<QC, CAP>(dpt, st, lse_row, del_row, p, col_in);
    uint32_t pa[QC / 16][4], dsa[QC / 16][4];
#pragma unroll
    for (int kk = 0; kk < QC / 16; ++kk) {
      acc_to_a<T>(pa[kk], st, kk);
      acc_to_a<T>(dsa[kk], dpt, kk);
    }
    // P^T and dS^T into buffer it % 2, columns [32c, 32c + 32). The buffer was last read by step it - 2's wgmmas,
    // which both consumers completed before step it - 1's barrier.
    const uint32_t pt_u = sdS_u + (it & 1) * K_::DS_BYTES, ds_u = pt_u + K_::PT_BYTES;
    store_ds<QC, K_::DS_PANEL>(pt_u, pa, 16 * warp, lane, QC * c);
    store_ds<QC, K_::DS_PANEL>(ds_u, dsa, 16 * warp, lane, QC * c);
    tk::fence_async_shared();
    tk::named_sync(1, NC * 128);

    // Columns [128c, 128c + 128): dV += P^T dO, dK += dS^T Q (A: [key][query], K-major; B: the tile's panels 2c,
    // 2c + 1, MN-major), dQ = dS K (A: dS^T read MN-major; B: K's panels 2c, 2c + 1).
    float dq[DC / 2];
    const uint64_t pta = desc_kmajor(pt_u), dsk = desc_kmajor(ds_u), dsm = desc_mnmajor(ds_u, K_::DS_PANEL);
    const uint64_t dob = desc_mnmajor(dos + 2 * c * BM * 128, BM * 128), qsb = desc_mnmajor(qs + 2 * c * BM * 128, BM * 128);
    tk::warpgroup::mma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      tk::warpgroup::mma_ss<T, 0, 1>(dv, kmajor_step(pta, kk, BN), mnmajor_step(dob, kk), 1);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      tk::warpgroup::mma_ss<T, 0, 1>(dk, kmajor_step(dsk, kk, BN), mnmajor_step(qsb, kk), 1);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      tk::warpgroup::mma_ss<T, 1, 1>(dq, mnmajor_step(dsm, kk), mnmajor_step(kb, kk), kk > 0);
    tk::warpgroup::mma_commit();
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(dq);
    tk::warpgroup::hold(dk);
    tk::warpgroup::hold(dv);

    // dQ's block into this consumer's Q panels (columns 0..63 of its block) and dO panels (64..127), then into
    // dq_accum by reduce-add; the stage goes back to the producer once they have read it.
    const uint32_t q_stage = qs + 2 * c * BM * 128, do_stage = dos + 2 * c * BM * 128;
    stage_dq<DC / 2>(q_stage, reinterpret_cast<const float(&)[DC / 4]>(dq[0]), 16 * warp, lane);
    stage_dq<DC / 2>(do_stage, reinterpret_cast<const float(&)[DC / 4]>(dq[DC / 4]), 16 * warp, lane);
    tk::fence_async_shared();
    tk::named_sync(3 + c, 128);
    if (tid == 0) {
      const uint8_t* boxes[2] = {sm.sQ + s * K_::Q_BYTES + 2 * c * BM * 128, sm.sdO + s * K_::Q_BYTES + 2 * c * BM * 128};
#pragma unroll
      for (int bx = 0; bx < K_::DQ_BOXES; ++bx)
        tk::tma::reduce_add_async(&dqmap, boxes[bx / 2] + (bx % 2) * 8192, DC * c + 32 * bx, i0, bh);
      tk::tma::store_commit();
      tk::tma::store_read_wait();
      tk::arrive(sm.q_empty[s]);
    }
  }
  if (tid == 0) tk::tma::store_wait();

  store_dkdv<T, DC, K_>(sm, p, dkv, dk, dv, b, hk, n0, DC * c, c, tid, row_in, col_in);
}

}  // namespace
}  // namespace tk_attn
