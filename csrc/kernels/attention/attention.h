// Torch-free interface of the attention kernels (used by binding.cpp).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace tk_attn {

enum class DType { bf16, f16 };

// A (B, H, S, D) view with element strides; the last dim is contiguous.
struct View4 {
  const void* ptr;
  int64_t B, H, S, D;
  int64_t sb, sh, ss;
};

// o: (B, N, Hq, D) contiguous; lse: (B, Hq, N) fp32 contiguous. next_task: null for the static schedule, or a
// zeroed device int for the dynamic one (the binding's choice: dynamic under a causal mask, whose tasks differ in
// length; static without one, whose equal tasks the static shares balance). Returns nullptr on success, else a
// static error string.
const char* attention_forward(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                              bool causal, float scale, int num_sms, int* next_task, cudaStream_t stream);

// Scratch sizes (bytes) the backward needs: fp32 dq accumulator, padded log2-domain lse and rowsum(do * o) (the
// backward's q tile for this head dim sets the padding).
struct BwdScratch {
  size_t dq_accum_bytes, lse2_bytes, delta_bytes;
};
BwdScratch attention_backward_scratch(const View4& q);

// dq (B,Hq,N,D), dk/dv (B,Hkv,M,D), written in their views' strides (16-byte aligned rows, strides multiples of 8
// elements). dq_accum needs no init (the pre-kernel zeroes it).
const char* attention_backward(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                               const View4& o, const float* lse, const View4& dq, const View4& dk, const View4& dv,
                               float* dq_accum, float* lse2, float* delta, bool causal, float scale, int num_sms,
                               cudaStream_t stream);

}  // namespace tk_attn
