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

// o: (B, N, Hq, D) contiguous; lse: (B, Hq, N) fp32 contiguous.
// variant: which forward kernel (0 .. attention_forward_variants() - 1, see
// README.md), or -1 for the default. next_task: null for the static schedule,
// or a zeroed device int for the dynamic one (TK_ATTN_FWD_SCHEDULE). Returns
// nullptr on success, else a static error string.
const char* attention_forward(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                              bool causal, float scale, int variant, int num_sms, int* next_task,
                              cudaStream_t stream);
int attention_forward_variants();

// Scratch sizes (bytes) the backward needs: fp32 dq accumulator, padded
// log2-domain lse and rowsum(do * o), for the given backward variant (its q
// tile sets the padding; -1 = the default).
struct BwdScratch {
  size_t dq_accum_bytes, lse2_bytes, delta_bytes;
};
BwdScratch attention_backward_scratch(const View4& q, int variant);

// dq (B,Hq,N,D), dk/dv (B,Hkv,M,D) contiguous. dq_accum needs no init (the pre-kernel zeroes it).
// variant: 0 .. attention_backward_variants() - 1 (see README.md), -1 = default. sections: the block order
// (TK_ATTN_BWD_ORDER): false = head by head, true = L2 sections of heads with key blocks outermost.
const char* attention_backward(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                               const View4& o, const float* lse, void* dq, void* dk, void* dv, float* dq_accum,
                               float* lse2, float* delta, bool causal, float scale, int variant, int num_sms,
                               bool sections, cudaStream_t stream);
int attention_backward_variants();

}  // namespace tk_attn
