// Attention forward: the dispatch on dtype, head dim and mask to the launchers of forward_launch.cuh (head dims up to
// 64 run the D = 64 kernels, up to 128 the D = 128 ones, up to 192 and 256 the D = 192 and 256 ones).
#include "attention.h"
#include "common.cuh"

namespace tk_attn {

// The launcher of one (dtype, head dim, mask): forward_launch.cuh, instantiated in
// forward_<dtype>_d<head dim>_<causal|full>.cu so that the sixteen compile in parallel.
template <typename T, int D, bool CAUSAL>
const char* forward_config(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                           const Scores& sc, int num_sms, int* next_task, cudaStream_t stream);
// The dropout kernels of one (dtype, head dim <= 128), both masks: forward_dropout_<dtype>_d<head dim>.cu.
template <typename T, int D>
const char* forward_dropout_config(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                                   const Scores& sc, int num_sms, int* next_task, cudaStream_t stream);

const char* attention_forward(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                              const Scores& sc, int num_sms, int* next_task, cudaStream_t stream) {
  if (const char* e = scores_error(sc)) return e;
  const int n = num_sms;
  if (!head_dim_supported(q.D)) return "head dim must be a multiple of 8 up to 256";
  if (sc.dropout.enabled) {
    if (q.D > kMaxDropoutHeadDim) return "dropout takes head dims up to 128";
    const auto drop = [&]<typename T>() {
      return q.D > 64 ? forward_dropout_config<T, 128>(dt, q, k, v, o, lse, sc, n, next_task, stream)
                      : forward_dropout_config<T, 64>(dt, q, k, v, o, lse, sc, n, next_task, stream);
    };
    return dt == DType::bf16 ? drop.template operator()<__nv_bfloat16>() : drop.template operator()<__half>();
  }
  const auto by_mask = [&]<typename T, int D>() {
    return sc.causal ? forward_config<T, D, true>(dt, q, k, v, o, lse, sc, n, next_task, stream)
                     : forward_config<T, D, false>(dt, q, k, v, o, lse, sc, n, next_task, stream);
  };
  if (q.D > 192)  // the D = 256 kernels, zero-filled past the head dim
    return dt == DType::bf16 ? by_mask.template operator()<__nv_bfloat16, 256>()
                             : by_mask.template operator()<__half, 256>();
  if (q.D > 128)
    return dt == DType::bf16 ? by_mask.template operator()<__nv_bfloat16, 192>()
                             : by_mask.template operator()<__half, 192>();
  if (q.D > 64)
    return dt == DType::bf16 ? by_mask.template operator()<__nv_bfloat16, 128>()
                             : by_mask.template operator()<__half, 128>();
  return dt == DType::bf16 ? by_mask.template operator()<__nv_bfloat16, 64>()
                           : by_mask.template operator()<__half, 64>();
}

}  // namespace tk_attn
