// The dropout backward at head dim 64 (backward_kernels.cuh), both dtypes, in a unit of its own so that it compiles
// beside the others.
#include "backward_launch.cuh"

namespace tk_attn {

const char* attention_backward_dropout_d64(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                                           const View4& o, const float* lse, const View4& dq, const View4& dk, const View4& dv,
                                           float* dq_accum, float* lse2, float* delta, const Scores& sc, int num_sms,
                                           cudaStream_t stream) {
  return run_bwd_dropout<64>(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum, lse2, delta, sc, num_sms, stream);
}

}  // namespace tk_attn
