// The attention forward kernels (the ping-pong schedule) on the pieces of forward.cuh; forward_launch.cuh launches
// them.
#pragma once
#include "forward.cuh"

namespace tk_attn {
namespace {

// Normalise this thread's rows r0 and r0 + 8 of O (and its quad's) and store them from registers into the
// (B, N, Hq, D) buffer, with the natural-log LSE (a row that saw no key: 0 and +inf). mx2: the rows' max in the
// log2 domain; sum: this thread's partial row sums.
template <typename T, int D>
__device__ __forceinline__ void store_rows(const FwdParams& p, const float (&o)[D / 2], const float (&mx2)[2],
                                           const float (&sum)[2], int b, int h, int bh, int r0, int col_in, int lane) {
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    float l = sum[h2];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? tk::rcp_approx(l) : 0.f;
    const int row = r0 + 8 * h2;
    if (row < p.N) {
      T* orow = static_cast<T*>(p.o) + ((static_cast<int64_t>(b) * p.N + row) * p.Hq + h) * p.d;
#pragma unroll
      for (int ch = 0; ch < D / 8; ++ch) {
        const uint32_t v = pack2<T>(o[4 * ch + 2 * h2] * inv, o[4 * ch + 2 * h2 + 1] * inv);
        if (8 * ch < p.d) *reinterpret_cast<uint32_t*>(orow + 8 * ch + col_in) = v;
      }
      if ((lane & 3) == 0)
        p.lse[static_cast<int64_t>(bh) * p.N + row] =
            l > 0.f ? (mx2[h2] + tk::lg2_approx(l)) * 0.69314718055994531f : INFINITY;
    }
  }
}

// ---- ping-pong schedule --------------------------------------------------
// Each consumer warpgroup issues its GEMMs in "rounds": round 0 = S_0 = Q K_0^T,
// round j+1 = S_{j+1} = Q K_{j+1}^T together with O += P_j V_j, last round =
// the final PV. Rounds of the warpgroups take turns (named barriers, round
// robin), so the tensor cores run one warpgroup's round while the others do
// their softmax (inter-warpgroup overlap); inside a warpgroup the softmax of
// S_{j+1} runs while PV_j is still in flight (intra-warpgroup overlap).
// The max is kept on raw scores and folded into one FFMA per element, which
// needs scale > 0 (the binding folds other scales into q: binding.cpp, attention).
// CAP: the scores are softcapped first (cap_out * tanh(cap_in * s)), and the max is kept on the capped scores
// (then the exponent's factor is log2 e > 0 whatever the scale). DROP: dropout (dropout.cuh) zeroes the dropped
// probabilities after the row sums have taken them, and finish scales O by 1 / (1 - p).
template <typename T, typename Cfg, bool CAP, bool DROP>
struct PP {
  using K_ = Fwd<T, Cfg>;
  static constexpr int D = K_::D, BN = K_::BN, BM = K_::BM;

  // This warpgroup's turns at the tensor cores (named barrier 1 + c is warpgroup c's; 0 is __syncthreads).
  using Turn = Turns<true, 1, Cfg::NC>;

  static __device__ __forceinline__ void issue_qk(float (&sc)[K_::S_REGS], uint32_t sQ_u, uint32_t sK_s) {
    const uint64_t qa = desc_kmajor(sQ_u), kb = desc_kmajor(sK_s);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t da = kmajor_step(qa, kk, BM);
      const uint64_t db = kmajor_step(kb, kk, BN);
      tk::warpgroup::mma_ss<T, 0, 0>(sc, da, db, kk > 0);
    }
    tk::warpgroup::mma_commit();
  }
  static __device__ __forceinline__ void issue_pv(float (&o)[K_::O_REGS], const uint32_t (&pa)[BN / 16][4],
                                                  uint32_t sV_s) {
    const uint64_t vb = desc_mnmajor(sV_s, BN * 128);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) tk::warpgroup::mma_rs<T, 1>(o, pa[kk], mnmajor_step(vb, kk), 1);
    tk::warpgroup::mma_commit();
  }

  // S (raw scores) -> P = exp2(S*scale_log2 - max*scale_log2) in place, with
  // the running max (raw units) and thread-partial row sums updated and the
  // factor alpha by which O must be rescaled. MASK: the keys outside each row's (row_keys of batch entry b); a row
  // that sees no key of this block or an earlier one keeps max -inf and P = 0. bh: the query head (DROP's stream).
  template <bool MASK>
  static __device__ __forceinline__ void softmax(float (&sc)[K_::S_REGS], float (&mx)[2], float (&sum)[2],
                                                 float (&alpha)[2], float sl2, int n0, int r0, int b, int bh,
                                                 int col_in, const FwdParams& p) {
    if constexpr (CAP) {
#pragma unroll
      for (int i = 0; i < K_::S_REGS; ++i) sc[i] = p.cap_out * tk::tanh_approx(sc[i] * p.cap_in);
    }
    if constexpr (MASK) {
      const int2 rk[2] = {row_keys(p, b, r0), row_keys(p, b, r0 + 8)};
#pragma unroll
      for (int ch = 0; ch < BN / 8; ++ch)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + 8 * ch + col_in + (e & 1);
          if (col < rk[e >> 1].x || col > rk[e >> 1].y) sc[4 * ch + e] = -INFINITY;
        }
    }
    float msc[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      float m = mx[h2];
#pragma unroll
      for (int ch = 0; ch < BN / 8; ++ch) m = fmaxf(m, fmaxf(sc[4 * ch + 2 * h2], sc[4 * ch + 2 * h2 + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float ms = MASK && m == -INFINITY ? 0.f : m;  // no key seen yet: P = 0, not NaN
      alpha[h2] = tk::ex2_approx((mx[h2] - ms) * sl2);  // first block: 2^-inf = 0
      mx[h2] = m;
      msc[h2] = ms * sl2;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int ch = 0; ch < BN / 8; ++ch)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = fmaf(sc[4 * ch + e], sl2, -msc[e >> 1]);
        const float pe = tk::ex2_approx(x);
        sc[4 * ch + e] = pe;
        rs[e >> 1] += pe;
      }
    sum[0] = sum[0] * alpha[0] + rs[0];
    sum[1] = sum[1] * alpha[1] + rs[1];
    if constexpr (DROP) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const uint32_t keep = p.drop.keep8_queries(bh, r0, n0 + 16 * kk + col_in);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (!((keep >> e) & 1u)) sc[8 * kk + e] = 0.f;
      }
    }
  }

  static __device__ __forceinline__ void rescale(float (&o)[K_::O_REGS], const float (&alpha)[2]) {
#pragma unroll
    for (int ch = 0; ch < D / 8; ++ch) {
      o[4 * ch + 0] *= alpha[0];
      o[4 * ch + 1] *= alpha[0];
      o[4 * ch + 2] *= alpha[1];
      o[4 * ch + 3] *= alpha[1];
    }
  }
  static __device__ __forceinline__ void to_a(uint32_t (&pa)[BN / 16][4], const float (&sc)[K_::S_REGS]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) acc_to_a<T>(pa[kk], sc, kk);
  }
  // Keeps P alive (its registers are read by the in-flight PV wgmma) until here.
  static __device__ __forceinline__ void hold(uint32_t (&pa)[BN / 16][4]) { tk::warpgroup::hold(pa); }
};

template <typename T, typename Cfg, bool DYN, bool CAP, bool DROP>
__global__ void __launch_bounds__(Fwd<T, Cfg>::THREADS, 1)
    attention_fwd_pp_kernel(const __grid_constant__ CUtensorMap qmap, const __grid_constant__ CUtensorMap kmap,
                            const __grid_constant__ CUtensorMap vmap, const __grid_constant__ CUtensorMap omap,
                            const FwdParams p) {
  using K_ = Fwd<T, Cfg>;
  using S = PP<T, Cfg, CAP, DROP>;
  static_assert(!DROP || Cfg::OSTAGE, "dropout's 1 / (1 - p) is applied where O is staged");
  constexpr int D = K_::D, NC = K_::NC, BN = K_::BN, STAGES = K_::STAGES, BM = K_::BM;
  extern __shared__ uint8_t smem_raw[];
  // K and V stages are released separately: K as soon as its QK^T is done,
  // so the next K can land while V is still read by PV.
  const FwdSmem<K_> sm(smem_raw);
  uint8_t *sQ = sm.sQ, *sK = sm.sK, *sV = sm.sV;
  tk::semaphore *q_full = sm.q_full, *q_empty = sm.q_empty, *k_full = sm.k_full, *v_full = sm.v_full;
  tk::semaphore *k_empty = sm.k_empty, *v_empty = sm.v_empty;
  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  sm.init();

  if (wg == 0) {  // ---------------- producer ----------------
    fwd_producer<K_, DYN>(sm, p, &qmap, &kmap, &vmap, tid);
    return;
  }

  // ---------------- consumers ----------------
  tk::warpgroup::increase_registers<Cfg::REG_CONS>();
  const int c = tk::warp_uniform(wg - 1);  // uniform: the descriptors below stay in uniform registers
  const int warp = tid / 32, lane = tid % 32;
  const int row_in = 16 * warp + lane / 4;
  const int col_in = 2 * (lane % 4);
  const uint32_t sQ_u = tk::smem_addr(sQ) + c * 64 * 128;
  const uint32_t sK_u = tk::smem_addr(sK), sV_u = tk::smem_addr(sV);
  const float sl2 = p.scale_log2;
  if (c == NC - 1) S::Turn::pass(c);  // warpgroup 0 takes the first turn

  // A task's place and extent for this warpgroup. Its key blocks are counted from the first one the producer
  // streams (key_blocks' lo). The warpgroup computes only the blocks its own 64 rows can see, [skip, nb): it releases
  // the others with empty turns, so a small window (or a band) costs about the blocks it touches, not the tile's.
  // Block r needs a mask when r < lead (left of some row's first key) or r >= free (the key tail or the causal
  // diagonal).
  struct Task {
    int bh, b, m0, r0, lo;
    int qs;    // its Q slot
    int nblk;  // key blocks the producer streams
    int skip;  // leading blocks before this warpgroup's first row's first key (fewer than nb)
    int nb;    // blocks up to its last row's last key, at least one
    int lead, free;
  };
  auto task_of = [&](int t) {
    Task k;
    int qb;
    decode_task(p, t, k.bh, qb);
    k.m0 = qb * BM;
    k.r0 = k.m0 + 64 * c + row_in;
    k.b = k.bh / p.Hq;
    const int2 kb = key_blocks<BN>(p, k.b, k.m0, BM);
    const int a = k.m0 + 64 * c;  // this warpgroup's first row
    // the keys of its first and last rows (both bounds are nondecreasing along the rows)
    const int2 first = row_keys(p, k.b, a), last = row_keys(p, k.b, a + 63);
    k.lo = kb.x;
    k.nblk = kb.y - kb.x;
    k.nb = min(max(1, (last.y + BN) / BN - kb.x), k.nblk);
    k.skip = min(max(0, first.x / BN - kb.x), k.nb - 1);
    k.lead = max(0, (last.x + BN - 1) / BN - kb.x);
    k.free = (first.y + 1) / BN - kb.x;
    return k;
  };
  int it = 0;  // key blocks consumed so far: the ring's phases
  float o[K_::O_REGS];
  float mx[2], sum[2], alpha[2];
  float sc[K_::S_REGS];
  uint32_t pa[BN / 16][4];

  // A block this warpgroup does not compute: its stages released once they have landed, and its (empty) turn taken,
  // so every warpgroup runs nblk + 1 turns per task.
  auto pass_block = [&](int pos) {
    const int s = pos % STAGES;
    tk::wait(k_full[s], (pos / STAGES) & 1);
    tk::warp::arrive(k_empty[s]);
    tk::wait(v_full[s], (pos / STAGES) & 1);
    tk::warp::arrive(v_empty[s]);
    S::Turn::wait(c);
    S::Turn::pass(c);
  };
  // Round 0 of the block's task ti (its Q slot and phase from ti): the leading blocks passed, and the task's blocks
  // counted from the first computed one from here on; S_0 issued on this warpgroup's turn ...
  auto round0_issue = [&](Task& k, int ti) {
    k.qs = sm.q_slot(ti);
    for (int j = 0; j < k.skip; ++j) pass_block(it + j);
    it += k.skip;
    k.lo += k.skip;
    k.nblk -= k.skip;
    k.nb -= k.skip;
    k.lead = max(0, k.lead - k.skip);
    k.free -= k.skip;
    k.skip = 0;
    tk::wait(q_full[k.qs], sm.q_phase(ti));
    const int s = it % STAGES;
    tk::wait(k_full[s], (it / STAGES) & 1);
    S::Turn::take(c, [&] {
      tk::warpgroup::mma_fence();
      S::issue_qk(sc, sQ_u + k.qs * K_::Q_BYTES, sK_u + s * K_::KV_BYTES);
    });
  };
  // ... and, once it is done, its softmax starts the task's statistics; O starts at zero.
  auto round0_finish = [&](const Task& k) {
    tk::warpgroup::mma_async_wait<0>();
    tk::warpgroup::hold(sc);
    tk::warp::arrive(k_empty[it % STAGES]);
#pragma unroll
    for (int i = 0; i < K_::O_REGS; ++i) o[i] = 0.f;
    mx[0] = mx[1] = -INFINITY;
    sum[0] = sum[1] = 0.f;
    if (k.lead == 0 && k.free > 0)
      S::template softmax<false>(sc, mx, sum, alpha, sl2, k.lo * BN, k.r0, k.b, k.bh, col_in, p);
    else
      S::template softmax<true>(sc, mx, sum, alpha, sl2, k.lo * BN, k.r0, k.b, k.bh, col_in, p);
    S::to_a(pa, sc);
  };
  // Rounds 1 .. nb-1 (S_{j+1} and PV_j; the softmax of S_{j+1} overlaps PV_j), the last PV, and the turns of
  // the blocks fully masked for this warpgroup.
  auto rounds = [&](const Task& k) {
    auto round = [&](int j, auto masked) {
      constexpr bool MASK = decltype(masked)::value;
      const int pos = it + j, pos1 = pos + 1;
      const int s = pos % STAGES, s1 = pos1 % STAGES;
      tk::wait(k_full[s1], (pos1 / STAGES) & 1);
      tk::wait(v_full[s], (pos / STAGES) & 1);
      S::Turn::take(c, [&] {
        tk::warpgroup::mma_fence();
        S::issue_qk(sc, sQ_u + k.qs * K_::Q_BYTES, sK_u + s1 * K_::KV_BYTES);
        S::issue_pv(o, pa, sV_u + s * K_::KV_BYTES);
      });
      tk::warpgroup::mma_async_wait<1>();
      tk::warpgroup::hold(sc);
      tk::warp::arrive(k_empty[s1]);
      S::template softmax<MASK>(sc, mx, sum, alpha, sl2, (k.lo + j + 1) * BN, k.r0, k.b, k.bh, col_in, p);
      tk::warpgroup::mma_async_wait<0>();
      tk::warpgroup::hold(o);
      S::hold(pa);
      tk::warp::arrive(v_empty[s]);
      S::rescale(o, alpha);
      S::to_a(pa, sc);
    };
    // Round j computes S_{j+1}: masked for j + 1 < lead and for j + 1 >= free, unmasked in between.
    const int first = min(max(k.lead - 1, 0), k.nb - 1), split = min(max(k.free - 1, first), k.nb - 1);
    for (int j = 0; j < first; ++j) round(j, std::true_type{});
    for (int j = first; j < split; ++j) round(j, std::false_type{});
    for (int j = split; j < k.nb - 1; ++j) round(j, std::true_type{});
    __syncwarp();
    if (lane == 0) tk::arrive(q_empty[k.qs]);  // this warpgroup's last QK^T is done: the slot may take a later Q
    // Last round: PV_{nb-1}.
    {
      const int pos = it + k.nb - 1;
      const int s = pos % STAGES;
      tk::wait(v_full[s], (pos / STAGES) & 1);
      S::Turn::take(c, [&] {
        tk::warpgroup::mma_fence();
        S::issue_pv(o, pa, sV_u + s * K_::KV_BYTES);
      });
      tk::warpgroup::mma_async_wait<0>();
      tk::warpgroup::hold(o);
      S::hold(pa);
      tk::warp::arrive(v_empty[s]);
    }
    // The blocks past this warpgroup's last key (the causal diagonal, a band's end).
    for (int j = k.nb; j < k.nblk; ++j) pass_block(it + j);
    it += k.nblk;
  };
  // Finish: normalise, write O in (B, N, Hq, D) through the O stage and the natural-log LSE. Without branches (with
  // XTASK the next task's S_0 is in flight, and ptxas would serialize the wgmma): predicated stores, MUFU rcp/lg2.
  // Without the O stage (no XTASK there) each thread stores its rows' pairs from registers.
  auto finish = [&](const Task& k) {
    const int b = k.bh / p.Hq, h = k.bh % p.Hq;
    if constexpr (!Cfg::OSTAGE) {
      const float mx2[2] = {mx[0] * sl2, mx[1] * sl2};
      store_rows<T, D>(p, o, mx2, sum, b, h, k.bh, k.r0, col_in, lane);
      return;
    }
    // This warpgroup's rows of the O stage: free once its previous store has read them (named barrier 4 + c).
    tk::tma::store_read_wait_if(tid == 0);
    tk::named_sync(4 + c, 128);
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      float l = sum[h2];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = k.r0 + 8 * h2;
      // a row that saw no key: o = 0, lse = +inf
      const float inv = l > 0.f ? (DROP ? p.drop.scale * tk::rcp_approx(l) : tk::rcp_approx(l)) : 0.f;
      const uint32_t sO_u = tk::smem_addr(sm.sO);
#pragma unroll
      for (int ch = 0; ch < D / 8; ++ch)
        tk::st_shared(sO_u + (ch / 8) * BM * 128 + swz128(64 * c + row_in + 8 * h2, 8 * (ch % 8) + col_in, 2),
                  pack2<T>(o[4 * ch + 2 * h2] * inv, o[4 * ch + 2 * h2 + 1] * inv));
      tk::st_global_if(row < p.N && (lane & 3) == 0, p.lse + static_cast<int64_t>(k.bh) * p.N + row,
                   l > 0.f ? (mx[h2] * sl2 + tk::lg2_approx(l)) * 0.69314718055994531f : INFINITY);
    }
    tk::fence_async_shared();  // the rows written above, visible to the TMA unit
    tk::named_sync(4 + c, 128);
    const bool store = tid == 0 && k.m0 + 64 * c < p.N;
#pragma unroll
    for (int pn = 0; pn < K_::PANELS; ++pn)
      tk::tma::store_async_if(store, &omap, sm.sO + pn * BM * 128 + 64 * c * 128, pn * 64, k.m0 + 64 * c, h, b);
    tk::tma::store_commit_if(store);
  };

  if constexpr (!Cfg::XTASK) {
    int ti = 0;
    for (int t = blockIdx.x; t < p.tasks; t += DYN ? consumer_step(sm, t, ti + 1) : gridDim.x, ++ti) {
      Task k = task_of(t);
      round0_issue(k, ti);
      round0_finish(k);
      rounds(k);
      finish(k);
    }
  } else if (blockIdx.x < p.tasks) {
    // XTASK: the next task's S_0 is issued before this task's finish, so the tensor cores have it to work on
    // while both warpgroups normalise and store O (the turn order is the same as above).
    int t = blockIdx.x, ti = 0;
    Task k = task_of(t);
    round0_issue(k, ti);
    round0_finish(k);
    while (true) {
      rounds(k);
      const int tn = t + (DYN ? int(consumer_step(sm, t, ti + 1)) : int(gridDim.x));
      if (tn >= p.tasks) {
        finish(k);
        break;
      }
      Task kn = task_of(tn);
      round0_issue(kn, ti + 1);
      finish(k);
      round0_finish(kn);
      k = kn;
      t = tn;
      ++ti;
    }
  }
  if (c == 0) S::Turn::wait(c);  // consume the last warpgroup's final hand-over
  if (tid == 0) tk::tma::store_wait();  // the stores read shared memory until they are done
}

}  // namespace
}  // namespace tk_attn
