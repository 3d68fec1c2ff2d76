// Attention forward on Hopper: one producer warpgroup streams K/V tiles with
// TMA through a STAGES-deep ring; NC consumer warpgroups each own 64 query
// rows, compute S = Q K^T and O += P V on wgmma, and keep the online softmax
// (exp2 domain, fp32 max and sum) in registers. Persistent grid; tasks are
// (batch*head, query block) in an L2-friendly, heavy-first order.
#include <cmath>

#include "attention.h"
#include "common.cuh"
#include "tma.cuh"

namespace tk_attn {
namespace {

template <int D>
struct FwdCfg;
// D=128: 2 consumers x 64 rows, 128-key tiles, 2 stages: 160 KB of shared memory.
template <>
struct FwdCfg<128> {
  static constexpr int NC = 2, BN = 128, STAGES = 2, REG_CONS = 240, REG_PROD = 24;
};
// D=64: registers allow a third consumer warpgroup (more rows per K/V load).
template <>
struct FwdCfg<64> {
  static constexpr int NC = 3, BN = 128, STAGES = 4, REG_CONS = 160, REG_PROD = 32;
};

template <typename T, int D>
struct Fwd {
  using C = FwdCfg<D>;
  static constexpr int NC = C::NC, BN = C::BN, STAGES = C::STAGES;
  static constexpr int BM = 64 * NC;
  static constexpr int PANELS = D / 64;
  static constexpr int THREADS = (NC + 1) * 128;
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(BN % 16 == 0 && BN <= 256, "key tile");
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int KV_BYTES = BN * D * 2;  // one K (or V) tile
  static constexpr int SMEM = Q_BYTES + 2 * STAGES * KV_BYTES + 1024 /*align*/ + 256 /*barriers*/;
  static constexpr int S_REGS = BN / 2;  // 64 x BN fp32 accumulator per thread
  static constexpr int O_REGS = D / 2;
};

struct FwdParams {
  int B, Hq, Hkv, N, M, group;
  int nq, tasks, section;  // query blocks per head, total tasks, heads per L2 section
  float scale_log2;
  bool causal;
  void* o;
  float* lse;
};

// Task t -> (batch*head, query block). Heads are walked in sections small
// enough that their K/V stay in L2 while the grid works on them; inside a
// section, query blocks go outermost and (for causal) last-first, so the
// heaviest blocks start first and the light ones fill the tail.
__device__ __forceinline__ void decode_task(const FwdParams& p, int t, int& bh, int& qb) {
  const int BH = p.B * p.Hq;
  const int per_section = p.section * p.nq;
  const int sec = t / per_section;
  const int r = t - sec * per_section;
  const int heads = min(p.section, BH - sec * p.section);
  const int rank = r / heads;
  bh = sec * p.section + (r - rank * heads);
  qb = p.causal ? p.nq - 1 - rank : rank;
}

template <typename T, int D>
__global__ void __launch_bounds__(Fwd<T, D>::THREADS, 1)
    attention_fwd_kernel(const __grid_constant__ CUtensorMap qmap, const __grid_constant__ CUtensorMap kmap,
                         const __grid_constant__ CUtensorMap vmap, const FwdParams p) {
  using K_ = Fwd<T, D>;
  constexpr int NC = K_::NC, BN = K_::BN, STAGES = K_::STAGES, BM = K_::BM, PANELS = K_::PANELS;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sQ = smem;                                        // [PANELS][BM][64]
  uint8_t* sK = sQ + K_::Q_BYTES;                            // [STAGES][PANELS][BN][64]
  uint8_t* sV = sK + STAGES * K_::KV_BYTES;                  // [STAGES][PANELS][BN][64]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + STAGES * K_::KV_BYTES);
  uint64_t* q_full = bars;
  uint64_t* q_empty = bars + 1;
  uint64_t* k_full = bars + 2;
  uint64_t* v_full = k_full + STAGES;
  uint64_t* kv_empty = v_full + STAGES;

  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    bar_init(q_full, 1);
    bar_init(q_empty, NC * 4);  // one arrival per consumer warp
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&k_full[s], 1);
      bar_init(&v_full[s], 1);
      bar_init(&kv_empty[s], NC * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ---------------- producer ----------------
    reg_dealloc<Fwd<T, D>::C::REG_PROD>();
    if (tid == 0) {
      tma_prefetch_desc(&qmap);
      tma_prefetch_desc(&kmap);
      tma_prefetch_desc(&vmap);
      int it = 0, ti = 0;
      for (int t = blockIdx.x; t < p.tasks; t += gridDim.x, ++ti) {
        int bh, qb;
        decode_task(p, t, bh, qb);
        const int b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
        const int m0 = qb * BM;
        bar_wait(q_empty, (ti & 1) ^ 1);
        bar_expect_tx(q_full, K_::Q_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn) tma_load_4d(sQ + pn * BM * 128, &qmap, q_full, pn * 64, m0, h, b);
        const int kv_end = p.causal ? min(p.M, min(p.N, m0 + BM)) : p.M;
        const int nblk = (kv_end + BN - 1) / BN;
        for (int j = 0; j < nblk; ++j, ++it) {
          const int s = it % STAGES;
          bar_wait(&kv_empty[s], ((it / STAGES) & 1) ^ 1);
          bar_expect_tx(&k_full[s], K_::KV_BYTES);
#pragma unroll
          for (int pn = 0; pn < PANELS; ++pn)
            tma_load_4d(sK + s * K_::KV_BYTES + pn * BN * 128, &kmap, &k_full[s], pn * 64, j * BN, hk, b);
          bar_expect_tx(&v_full[s], K_::KV_BYTES);
#pragma unroll
          for (int pn = 0; pn < PANELS; ++pn)
            tma_load_4d(sV + s * K_::KV_BYTES + pn * BN * 128, &vmap, &v_full[s], pn * 64, j * BN, hk, b);
        }
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  reg_alloc<Fwd<T, D>::C::REG_CONS>();
  const int c = wg - 1;
  const int warp = tid / 32, lane = tid % 32;
  const int row_in = 16 * warp + lane / 4;  // this thread's first row inside the warpgroup's 64
  const int col_in = 2 * (lane % 4);        // first column inside each 8-column chunk
  const uint32_t sQ_u = smem_u32(sQ) + c * 64 * 128;
  const uint32_t sK_u = smem_u32(sK), sV_u = smem_u32(sV);

  int it = 0, ti = 0;
  for (int t = blockIdx.x; t < p.tasks; t += gridDim.x, ++ti) {
    int bh, qb;
    decode_task(p, t, bh, qb);
    const int m0 = qb * BM;
    const int r0 = m0 + 64 * c + row_in;  // global rows r0 and r0 + 8
    const int kv_end = p.causal ? min(p.M, min(p.N, m0 + BM)) : p.M;
    const int nblk = (kv_end + BN - 1) / BN;

    float o[K_::O_REGS];
#pragma unroll
    for (int i = 0; i < K_::O_REGS; ++i) o[i] = 0.f;
    float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f};

    bar_wait(q_full, ti & 1);
    for (int j = 0; j < nblk; ++j, ++it) {
      const int s = it % STAGES;
      const uint32_t ph = (it / STAGES) & 1;
      float sc[K_::S_REGS];
      bar_wait(&k_full[s], ph);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint64_t da = desc_kmajor(sQ_u + (kk / 4) * BM * 128 + (kk % 4) * 32);
        const uint64_t db = desc_kmajor(sK_u + s * K_::KV_BYTES + (kk / 4) * BN * 128 + (kk % 4) * 32);
        wgmma_op<T>::template ss<0, 0>(sc, da, db, kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sc);
      if (j == nblk - 1) {  // Q is no longer read by this warp for this task
        __syncwarp();
        if (lane == 0) bar_arrive(q_empty);
      }

      // Scores to the log2 domain; mask key tails and the causal upper triangle.
      const int n0 = j * BN;
      const bool need_mask = (n0 + BN > p.M) || (p.causal && n0 + BN - 1 > m0 + 64 * c);
#pragma unroll
      for (int ch = 0; ch < BN / 8; ++ch) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = sc[4 * ch + e] * p.scale_log2;
          if (need_mask) {
            const int col = n0 + 8 * ch + col_in + (e & 1);
            const int row = r0 + 8 * (e >> 1);
            if (col >= p.M || (p.causal && col > row)) x = -INFINITY;
          }
          sc[4 * ch + e] = x;
        }
      }
      float alpha[2];
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        float m = mx[h2];
#pragma unroll
        for (int ch = 0; ch < BN / 8; ++ch) m = fmaxf(m, fmaxf(sc[4 * ch + 2 * h2], sc[4 * ch + 2 * h2 + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        alpha[h2] = exp2f(mx[h2] - m);  // first block: exp2(-inf) = 0
        mx[h2] = m;
        sum[h2] *= alpha[h2];
      }
#pragma unroll
      for (int ch = 0; ch < BN / 8; ++ch) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pe = exp2f(sc[4 * ch + e] - mx[e >> 1]);
          sc[4 * ch + e] = pe;
          sum[e >> 1] += pe;
        }
      }
#pragma unroll
      for (int ch = 0; ch < D / 8; ++ch) {
        o[4 * ch + 0] *= alpha[0];
        o[4 * ch + 1] *= alpha[0];
        o[4 * ch + 2] *= alpha[1];
        o[4 * ch + 3] *= alpha[1];
      }

      uint32_t pa[BN / 16][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) acc_to_a<T>(pa[kk], sc, kk);
      bar_wait(&v_full[s], ph);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const uint64_t db = desc_mnmajor(sV_u + s * K_::KV_BYTES + kk * 16 * 128, BN * 128);
        wgmma_op<T>::template rs<1>(o, pa[kk], db, 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pa[kk][e])::"memory");
      __syncwarp();
      if (lane == 0) bar_arrive(&kv_empty[s]);
    }

    // Finish: normalise, write O in (B, N, Hq, D) and the natural-log LSE.
    const int b = bh / p.Hq, h = bh % p.Hq;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      float l = sum[h2];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = 1.f / l;
      const int row = r0 + 8 * h2;
      if (row < p.N) {
        T* orow = static_cast<T*>(p.o) + ((static_cast<int64_t>(b) * p.N + row) * p.Hq + h) * D;
#pragma unroll
        for (int ch = 0; ch < D / 8; ++ch) {
          const uint32_t v = pack2<T>(o[4 * ch + 2 * h2] * inv, o[4 * ch + 2 * h2 + 1] * inv);
          *reinterpret_cast<uint32_t*>(orow + 8 * ch + col_in) = v;
        }
        if ((lane & 3) == 0) p.lse[static_cast<int64_t>(bh) * p.N + row] = (mx[h2] + log2f(l)) * 0.69314718055994531f;
      }
    }
  }
}

template <typename T, int D>
const char* launch_fwd(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse, bool causal,
                       float scale, int num_sms, cudaStream_t stream) {
  using K_ = Fwd<T, D>;
  CUtensorMap qm, km, vm;
  if (const char* e = make_map(&qm, dt, q, K_::BM)) return e;
  if (const char* e = make_map(&km, dt, k, K_::BN)) return e;
  if (const char* e = make_map(&vm, dt, v, K_::BN)) return e;
  FwdParams p;
  p.B = q.B;
  p.Hq = q.H;
  p.Hkv = k.H;
  p.N = q.S;
  p.M = k.S;
  p.group = q.H / k.H;
  p.nq = (q.S + K_::BM - 1) / K_::BM;
  const int BH = q.B * q.H;
  p.tasks = BH * p.nq;
  p.section = std::max(1, std::min(BH, (2 * num_sms + p.nq - 1) / p.nq));
  p.scale_log2 = scale * 1.4426950408889634f;
  p.causal = causal;
  p.o = o;
  p.lse = lse;
  auto kern = attention_fwd_kernel<T, D>;
  // Per device, so set on every launch (cheap).
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, K_::SMEM) != cudaSuccess)
    return "cudaFuncSetAttribute failed for the attention forward kernel";
  const int grid = std::min(p.tasks, num_sms);
  kern<<<grid, K_::THREADS, K_::SMEM, stream>>>(qm, km, vm, p);
  return cudaGetLastError() == cudaSuccess ? nullptr : "attention forward launch failed";
}

}  // namespace

const char* attention_forward(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                              bool causal, float scale, int num_sms, cudaStream_t stream) {
  if (q.D == 128)
    return dt == DType::bf16 ? launch_fwd<__nv_bfloat16, 128>(dt, q, k, v, o, lse, causal, scale, num_sms, stream)
                             : launch_fwd<__half, 128>(dt, q, k, v, o, lse, causal, scale, num_sms, stream);
  if (q.D == 64)
    return dt == DType::bf16 ? launch_fwd<__nv_bfloat16, 64>(dt, q, k, v, o, lse, causal, scale, num_sms, stream)
                             : launch_fwd<__half, 64>(dt, q, k, v, o, lse, causal, scale, num_sms, stream);
  return "head dim must be 64 or 128";
}

}  // namespace tk_attn
