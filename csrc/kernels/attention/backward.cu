// Attention backward: the scratch sizes and the entry point, with the D = 64 and 128 kernels; the launch and the
// configurations are in backward_launch.cuh, the design in backward.cuh. D = 256 and the dropout kernels are compiled
// in their own units (backward_d256.cu, backward_dropout.cu).
#include "backward_launch.cuh"

namespace tk_attn {

BwdScratch attention_backward_scratch(const View4& q) {
  const int64_t D = bwd_d(q.D);
  const int64_t Npad = bwd_npad(q.S, bwd_bm(q.D));
  const int64_t BH = q.B * q.H;
  return {static_cast<size_t>(BH * Npad * D * 4), static_cast<size_t>(BH * Npad * 4),
          static_cast<size_t>(BH * Npad * 4)};
}

const char* attention_backward(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                               const View4& o, const float* lse, const View4& dq, const View4& dk, const View4& dv,
                               float* dq_accum, float* lse2, float* delta, const Scores& sc, int num_sms,
                               cudaStream_t stream) {
  if (const char* e = scores_error(sc)) return e;
  if (!head_dim_supported(q.D, kMaxBackwardHeadDim))
    return "the backward takes head dims that are multiples of 8 up to 256";
  if (sc.dropout.enabled) {
    if (q.D > kMaxDropoutHeadDim) return "dropout takes head dims up to 128";
    return attention_backward_dropout(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum, lse2, delta, sc, num_sms,
                                      stream);
  }
  switch (bwd_d(q.D)) {
    case 64:
      return run_bwd<64>(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum, lse2, delta, sc, num_sms, stream);
    case 128:
      return run_bwd<128>(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum, lse2, delta, sc, num_sms, stream);
    default:
      return attention_backward_d256(dt, dout, q, k, v, o, lse, dq, dk, dv, dq_accum, lse2, delta, sc, num_sms,
                                     stream);
  }
}

}  // namespace tk_attn
