// Attention forward: the dispatch on dtype and head dim to the kernels of forward_kernels.cuh (head dims up to 64 run
// the D = 64 kernels, up to 128 the D = 128 ones).
#include "attention.h"
#include "common.cuh"

namespace tk_attn {

// The launcher of one (dtype, head dim): forward_kernels.cuh, instantiated in forward_<dtype>_d<head dim>.cu so that
// the four compile in parallel.
template <typename T, int D>
const char* forward_config(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                           const Scores& sc, int num_sms, int* next_task, cudaStream_t stream);

const char* attention_forward(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                              const Scores& sc, int num_sms, int* next_task, cudaStream_t stream) {
  if (const char* e = scores_error(sc)) return e;
  const int n = num_sms;
  if (!head_dim_supported(q.D)) return "head dim must be a multiple of 8 up to 128";
  if (q.D > 64)  // the D = 128 kernels, zero-filled past the head dim
    return dt == DType::bf16 ? forward_config<__nv_bfloat16, 128>(dt, q, k, v, o, lse, sc, n, next_task, stream)
                             : forward_config<__half, 128>(dt, q, k, v, o, lse, sc, n, next_task, stream);
  return dt == DType::bf16 ? forward_config<__nv_bfloat16, 64>(dt, q, k, v, o, lse, sc, n, next_task, stream)
                           : forward_config<__half, 64>(dt, q, k, v, o, lse, sc, n, next_task, stream);
}

}  // namespace tk_attn
