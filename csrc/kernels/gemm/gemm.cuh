// Plain launch interface of the bf16 GEMM (torch-free; used by binding.cpp and tests).
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>

namespace tk_kernels {

// Pipeline depth and epilogue. The default is the fastest measured on an H200 (benchmarks/RESULTS.md).
struct gemm_config {
    int stages = 3;          // input ring depth: 1..4 (1..3 with tma_store; >= 2 with overlap)
    bool tma_store = true;   // stage the output tile in shared memory and TMA-store it (else store from registers)
    bool overlap = false;    // keep one k-block of wgmmas in flight per consumer
};

// c (M x N, row stride ldc) = a (M x K, row stride lda) @ b (K x N, row stride ldb), all bf16, fp32 accumulation.
// TMA needs a, b (and c with tma_store) 16-byte aligned with row strides that are multiples of 8 elements.
// Returns nullptr on success, else a message.
const char* gemm_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* c, int M, int N, int K,
                      long long lda, long long ldb, long long ldc, gemm_config cfg, cudaStream_t stream);

}  // namespace tk_kernels
