// Plain launch interface of the bf16 GEMM (torch-free; used by binding.cpp and tests).
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>

namespace tk_kernels {

// c (M x N, row stride ldc) = a (M x K, row stride lda) @ b (K x N, row stride ldb), all bf16, fp32 accumulation.
// TMA needs a, b 16-byte aligned with lda, ldb multiples of 8; c has no alignment needs.
// stages: input pipeline depth 1..4. tma_store: stage the output in shared memory and TMA-store it
// (needs c 16-byte aligned and ldc a multiple of 8; stages 1..3). Returns nullptr on success, else a message.
const char* gemm_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* c, int M, int N, int K,
                      long long lda, long long ldb, long long ldc, int stages, bool tma_store, cudaStream_t stream);

}  // namespace tk_kernels
