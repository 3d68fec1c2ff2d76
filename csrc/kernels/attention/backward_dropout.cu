// The dropout backward at head dims up to 128 (backward_kernels.cuh, both dtypes), in a unit of its own so that it
// compiles in parallel with backward.cu.
#include "backward_launch.cuh"

namespace tk_attn {

const char* attention_backward_dropout(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                                       const View4& o, const float* lse, const View4& dq, const View4& dk,
                                       const View4& dv, float* dq_accum, float* lse2, float* delta, const Scores& sc,
                                       int num_sms, cudaStream_t stream) {
  const auto run = bwd_d(q.D) == 64 ? run_bwd_dropout<64> : run_bwd_dropout<128>;
  return run(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum, lse2, delta, sc, num_sms, stream);
}

}  // namespace tk_attn
