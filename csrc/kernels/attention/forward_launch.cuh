// The attention forward's launch: launch_fwd (tensor maps, parameters, grid) for a kernel of forward_kernels.cuh, the
// configurations each head dim runs (FwdConfigs), and the launchers instantiated per (dtype, head dim, mask) in
// forward_<dtype>_d<head dim>_<causal|full>.cu and per (dtype, head dim) in forward_dropout_<dtype>_d<head dim>.cu.
#pragma once
#include "forward_kernels.cuh"
#include "params.cuh"

namespace tk_attn {
namespace {

template <typename T, typename Cfg, bool DYN, bool CAP, bool DROP = false>
const char* launch_fwd(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse, const Scores& sc,
                       int num_sms, int* next_task, cudaStream_t stream) {
  using K_ = Fwd<T, Cfg>;
  CUtensorMap qm, km, vm, om{};  // om: OSTAGE only
  if (const char* e = make_map(&qm, dt, q, K_::BM)) return e;
  if (const char* e = make_map(&km, dt, k, K_::BN)) return e;
  if (const char* e = make_map(&vm, dt, v, K_::BN)) return e;
  if constexpr (Cfg::OSTAGE) {  // o: (B, N, Hq, D) contiguous, as a (B, Hq, N, D) view; stored 64 rows per warpgroup
    const View4 ov{o, q.B, q.H, q.S, q.D, q.S * q.H * q.D, q.D, q.H * q.D};
    if (const char* e = make_map(&om, dt, ov, 64)) return e;
  }
  FwdParams p;
  fill_shared_params(p, q, k, sc);
  p.d = static_cast<int>(q.D);
  p.nq = (q.S + K_::BM - 1) / K_::BM;
  const int BH = q.B * q.H;
  p.tasks = BH * p.nq;
  p.section = section_heads(BH, p.nq, 2LL * num_sms, BH);
  constexpr float LOG2E = 1.4426950408889634f;
  p.scale_log2 = CAP ? LOG2E : sc.scale * LOG2E;
  p.cap_in = CAP ? sc.scale / sc.softcap : 0.f;
  p.cap_out = CAP ? sc.softcap : 0.f;
  p.row_keys = sc.row_keys;
  p.o = o;
  p.lse = lse;
  p.next_task = next_task;
  const auto kern = attention_fwd_pp_kernel<T, Cfg, DYN, CAP, DROP>;
  // Per device, so set on every launch (cheap).
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, K_::SMEM) != cudaSuccess)
    return "cudaFuncSetAttribute failed for the attention forward kernel";
  const int grid = std::min(p.tasks, num_sms);
  kern<<<grid, K_::THREADS, K_::SMEM, stream>>>(qm, km, vm, om, p);
  return cudaGetLastError() == cudaSuccess ? nullptr : "attention forward launch failed";
}

// The configurations the forward runs, per head dim (measured on the H200 against cuDNN: benchmarks/RESULTS.md).
// Ping-pong consumers (O stored by TMA but at D = 256), and at D = 128 without a mask also the next task's first scores
// under the current one's finish (XTASK; under a mask it spilled and ran 4% slower). They need scale > 0 (the max is
// kept on raw scores): the binding folds other scales into q.
template <int D>
struct FwdConfigs;
template <>
struct FwdConfigs<128> {
  using Causal = FwdCfg<128, 2, 128, 2>;
  using Full = FwdCfg<128, 2, 128, 2, true>;
  using DropoutCausal = Causal;  // the dropout kernels (DROP): the generator's registers fit beside Causal's
  using DropoutFull = Causal;
};
// D = 192 and 256: 80-key tiles, the largest whose two-stage K/V rings fit beside Q; at D = 256 that leaves no room
// for the O stage, so O is stored from registers (OSTAGE false), which measured faster than 48- or 64-key tiles with
// the stage or 32-key tiles with three stages; XTASK spilled at D = 256 and ran no faster at D = 192.
template <>
struct FwdConfigs<256> {
  using Causal = FwdCfg<256, 2, 80, 2, false, false>;
  using Full = Causal;
};
template <>
struct FwdConfigs<192> {
  using Causal = FwdCfg<192, 2, 80, 2>;
  using Full = Causal;
};
template <>
struct FwdConfigs<64> {
  using Causal = FwdCfg<64, 3, 128, 4>;
  using Full = Causal;
  // Dropout: three consumers at 160 registers spilled 192 bytes a thread; two at 240 ran 1.22-1.26x faster on the
  // H200, and XTASK 1.03-1.04x more without a mask (0.97-0.98x under the causal one, as without dropout).
  using DropoutCausal = FwdCfg<64, 2, 128, 4>;
  using DropoutFull = FwdCfg<64, 2, 128, 4, true>;
};

}  // namespace

// The launcher of one (dtype, head dim, mask), instantiated in forward_<dtype>_d<head dim>_<causal|full>.cu: the mask's
// configuration, on the dynamic schedule under a causal mask (its tasks differ in length; H200: 1.03-1.25x the static
// one there) and the static one without (equal tasks: 0.89-1.0x as dynamic). scale > 0 or a softcap (binding.cpp
// folds other scales into q).
template <typename T, int D, bool CAUSAL>
const char* forward_config(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                           const Scores& sc, int num_sms, int* next_task, cudaStream_t stream) {
  using Cs = FwdConfigs<D>;
  if (sc.causal != CAUSAL) return "the forward was dispatched to the other mask's kernels";
  if (CAUSAL && next_task == nullptr) return "the causal forward needs its task counter";
  const bool cap = sc.softcap > 0.f;
  if (!(sc.scale > 0.f) && !cap) return "the forward kernels take scale > 0 (or a softcap): fold the scale into q";
  using Cfg = std::conditional_t<CAUSAL, typename Cs::Causal, typename Cs::Full>;
  if (cap) return launch_fwd<T, Cfg, CAUSAL, true>(dt, q, k, v, o, lse, sc, num_sms, next_task, stream);
  return launch_fwd<T, Cfg, CAUSAL, false>(dt, q, k, v, o, lse, sc, num_sms, next_task, stream);
}

// The dropout kernels of one (dtype, head dim <= 128), instantiated in forward_dropout_<dtype>_d<head dim>.cu: the
// head dim's Dropout configurations (FwdConfigs), on the dynamic schedule under a causal mask.
template <typename T, int D>
const char* forward_dropout_config(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                                   const Scores& sc, int num_sms, int* next_task, cudaStream_t stream) {
  using Cs = FwdConfigs<D>;
  if (!sc.dropout.enabled) return "the forward was dispatched to the dropout kernels without dropout";
  if (sc.causal && next_task == nullptr) return "the causal forward needs its task counter";
  if (sc.causal)
    return launch_fwd<T, typename Cs::DropoutCausal, true, false, true>(dt, q, k, v, o, lse, sc, num_sms, next_task,
                                                                         stream);
  return launch_fwd<T, typename Cs::DropoutFull, false, false, true>(dt, q, k, v, o, lse, sc, num_sms, next_task,
                                                                      stream);
}

}  // namespace tk_attn
