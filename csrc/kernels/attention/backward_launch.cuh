// The attention backward's launch, shared by its translation units (backward.cu: D = 64 and 128;
// backward_d256.cu: D = 256): the pre kernel (delta, lse2, dq_accum zeroed), the post kernel (dq scaled and cast)
// and launch_bwd, which runs them around a main kernel (backward_kernels.cuh, backward_split.cuh). The design is in
// backward.cuh.
#pragma once
#include "backward_kernels.cuh"
#include "backward_split.cuh"
#include "params.cuh"

namespace tk_attn {
namespace {

template <typename T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }

// Per padded (bh, row): delta = rowsum(dO * O) - dlse (the gradient of lse, when given: d lse / d s = P, so
// dS = P * (dP - delta + dlse)), lse2 = lse * log2e, and the
// row of dq_accum zeroed (one pass instead of a separate fill). D / 8 lanes
// per row with 16-byte loads (o and dO rows are 16-byte aligned: tma_ready in
// the binding); lanes past the head dim o.D <= D read nothing. Rows in [N, Npad) get delta 0 and lse2 +inf so the
// main kernel needs no bounds. delta and lse2 go to their stats_slot (StatsPairs).
template <typename T, int D>
__global__ void attention_bwd_pre_kernel(View4 dout, View4 o, const float* lse, const float* dlse, float* lse2,
                                         float* delta, float* dq_accum, int Npad) {
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
    if (row < o.S && 8 * l < o.D) {
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
    delta[slot] = row < o.S ? acc - (dlse != nullptr ? dlse[bh * o.S + row] : 0.f) : 0.f;
    lse2[slot] = row < o.S ? lse[bh * o.S + row] * 1.4426950408889634f : INFINITY;
  }
}

// dq = dq_accum * scale, cast, into dq's strides; 8 elements per thread (the head dim d = dq.D <= D is a multiple of
// 8, so a group never crosses a row, and the binding's dq has 16-byte rows; dq_accum's rows are D wide). Each
// 8-column group of dq_accum holds its even columns, then its odd ones (stage_dq by stmatrix).
template <typename T, int D>
__global__ void attention_bwd_post_kernel(const float* dq_accum, View4 dq, int Npad, float scale) {
  const int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  const int64_t N = dq.S, BH = dq.B * dq.H, d = dq.D;
  if (idx >= BH * N * d) return;
  const int64_t bh = idx / (N * d);
  const int64_t rem = idx - bh * N * d, n = rem / d, col = rem - n * d;
  const float4* src = reinterpret_cast<const float4*>(dq_accum + (bh * Npad + n) * D + col);
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
  const int64_t b = bh / dq.H, h = bh - b * dq.H;
  T* row = static_cast<T*>(const_cast<void*>(dq.ptr)) + b * dq.sb + h * dq.sh + n * dq.ss;
  *reinterpret_cast<uint4*>(row + col) = out;
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

// A configuration's main kernel and its shape (Bwd, BwdWide or BwdSplit: SMEM, THREADS).
template <typename T, int D, class Cfg, bool CAP, bool DROP, Kind = Cfg::kind>
struct BwdKernel;
template <typename T, int D, class Cfg, bool CAP, bool DROP>
struct BwdKernel<T, D, Cfg, CAP, DROP, Kind::Tile64> {
  using K_ = Bwd<T, D, Cfg>;
  static auto kernel() { return attention_bwd_kernel<T, D, Cfg, CAP, DROP>; }
};
template <typename T, int D, class Cfg, bool CAP, bool DROP>
struct BwdKernel<T, D, Cfg, CAP, DROP, Kind::Wide> {
  static_assert(D == 64, "the wide kernel is D = 64");
  using K_ = BwdWide<T, Cfg>;
  static auto kernel() { return attention_bwd_wide_kernel<T, Cfg, CAP, DROP>; }
};
template <typename T, int D, class Cfg, bool CAP, bool DROP>
struct BwdKernel<T, D, Cfg, CAP, DROP, Kind::Split> {
  static_assert(D == 256 && !DROP, "the split kernel is D = 256, without dropout");
  using K_ = BwdSplit<T, Cfg>;
  static auto kernel() { return attention_bwd_split_kernel<T, Cfg, CAP>; }
};

template <typename T, int D, typename Cfg, bool CAP, bool DROP = false>
const char* launch_bwd(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v, const View4& o,
                       const float* lse, const View4& dq, const View4& dk, const View4& dv, float* dq_accum,
                       float* lse2, float* delta, const Scores& sc, int num_sms, cudaStream_t stream) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  const int Npad = static_cast<int>(bwd_npad(q.S, BM));
  const int64_t BH = q.B * q.H;
  {
    const int64_t lanes = BH * Npad * (D / 8);
    const int threads = 256;
    attention_bwd_pre_kernel<T, D><<<static_cast<unsigned>((lanes + threads - 1) / threads), threads, 0, stream>>>(
        dout, o, lse, sc.lse_grad, lse2, delta, dq_accum, Npad);
  }
  CUtensorMap qm, km, vm, dom;
  if (const char* e = make_map(&qm, dt, q, BM)) return e;
  if (const char* e = make_map(&km, dt, k, BN)) return e;
  if (const char* e = make_map(&vm, dt, v, BN)) return e;
  if (const char* e = make_map(&dom, dt, dout, BM)) return e;
  CUtensorMap dqm;
  if (const char* e = make_map_f32(&dqm, dq_accum, D, Npad, BH)) return e;
  DkvMaps dkvm{};  // dk, dv: (B, Hkv, M, D) in the binding's strides
  if (const char* e = make_map(&dkvm.dk, dt, dk, 64)) return e;
  if (const char* e = make_map(&dkvm.dv, dt, dv, 64)) return e;
  BwdParams p;
  fill_shared_params(p, q, k, sc);
  p.Npad = Npad;
  const float scale = sc.scale;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.cap_in = CAP ? scale / sc.softcap : 0.f;
  p.cap_log2 = CAP ? sc.softcap * 1.4426950408889634f : 0.f;
  p.cap_inv_log2 = CAP ? 1.f / p.cap_log2 : 0.f;
  p.key_rows = sc.key_rows;
  p.lse2 = lse2;
  p.delta = delta;
  p.dq_accum = dq_accum;
  p.nk = static_cast<int>((k.S + BN - 1) / BN);
  // L2 sections of heads, key blocks outermost, under a causal mask (its key blocks differ in cost); head by head
  // without one (its equal blocks are balanced already).
  p.section = bwd_section(sc.causal, num_sms, p.nk, k.B * k.H, p.group, q.S, D);
  using Main = BwdKernel<T, D, Cfg, CAP, DROP>;
  const auto kern = Main::kernel();
  constexpr int smem = Main::K_::SMEM, threads = Main::K_::THREADS;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return "cudaFuncSetAttribute failed for the attention backward kernel";
  kern<<<static_cast<unsigned>(p.nk * k.B * k.H), threads, smem, stream>>>(qm, km, vm, dom, dqm, dkvm, p);
  if (cudaGetLastError() != cudaSuccess) return "attention backward launch failed";
  {
    const int64_t groups = BH * q.S * q.D / 8;
    const int threads = 256;
    attention_bwd_post_kernel<T, D><<<static_cast<unsigned>((groups + threads - 1) / threads), threads, 0, stream>>>(
        dq_accum, dq, Npad, scale);
  }
  return cudaGetLastError() == cudaSuccess ? nullptr : "attention backward post-process launch failed";
}

// The configuration the backward runs, per head dim (measured on the H200 against cuDNN: benchmarks/RESULTS.md):
// at D = 128 the 64-row kernel with dS^T double-buffered and the consumers taking turns, at D = 64 the wide kernel
// (128-row q tiles) with a producer warp issuing the dQ reduce-adds, at D = 256 the split kernel.
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
template <>
struct BwdConfig<256> {
  using Cfg = BwdCfg<Kind::Split, 2>;
};

// The kernels' head dim for a head dim d: the next of 64, 128 and 256; and that configuration's q tile.
inline int bwd_d(int64_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }
inline int bwd_bm(int64_t d) {
  const int kd = bwd_d(d);
  return kd == 64 ? BwdConfig<64>::Cfg::BM : kd == 128 ? BwdConfig<128>::Cfg::BM : BwdConfig<256>::Cfg::BM;
}

// launch_bwd with this head dim's configuration, for the call's dtype, softcapped or not.
template <int D>
const char* run_bwd(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v, const View4& o,
                    const float* lse, const View4& dq, const View4& dk, const View4& dv, float* dq_accum, float* lse2,
                    float* delta, const Scores& sc, int num_sms, cudaStream_t stream) {
  using Cfg = typename BwdConfig<D>::Cfg;
  const auto run = [&](auto t, auto cap) {
    return launch_bwd<decltype(t), D, Cfg, decltype(cap)::value>(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum,
                                                                  lse2, delta, sc, num_sms, stream);
  };
  const auto with_cap = [&](auto t) {
    return sc.softcap > 0.f ? run(t, std::true_type{}) : run(t, std::false_type{});
  };
  return dt == DType::bf16 ? with_cap(__nv_bfloat16{}) : with_cap(__half{});
}

// launch_bwd's dropout kernels (no softcap) for this head dim's configuration (backward_dropout.cu).
template <int D>
const char* run_bwd_dropout(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                            const View4& o, const float* lse, const View4& dq, const View4& dk, const View4& dv,
                            float* dq_accum, float* lse2, float* delta, const Scores& sc, int num_sms,
                            cudaStream_t stream) {
  using Cfg = typename BwdConfig<D>::Cfg;
  const auto run = [&](auto t) {
    return launch_bwd<decltype(t), D, Cfg, false, true>(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum, lse2, delta,
                                                        sc, num_sms, stream);
  };
  return dt == DType::bf16 ? run(__nv_bfloat16{}) : run(__half{});
}

}  // namespace

// The dropout backward at D = 64 and 128 (backward_dropout.cu), behind attention_backward's checks.
const char* attention_backward_dropout(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                                       const View4& o, const float* lse, const View4& dq, const View4& dk,
                                       const View4& dv, float* dq_accum, float* lse2, float* delta, const Scores& sc,
                                       int num_sms, cudaStream_t stream);

// The D = 256 backward (backward_d256.cu), behind attention_backward's checks.
const char* attention_backward_d256(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                                    const View4& o, const float* lse, const View4& dq, const View4& dk,
                                    const View4& dv, float* dq_accum, float* lse2, float* delta, const Scores& sc,
                                    int num_sms, cudaStream_t stream);

}  // namespace tk_attn
