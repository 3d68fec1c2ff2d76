// The special-function unit alone, without the range fix-ups of exp2f/__frcp_rn/log2f/tanhf: for arguments the
// caller knows are in range (softmax exponents whose tiny results may flush to 0, row sums >= 1, capped scores).
#pragma once
#include "../../common.cuh"

namespace tk {

TK_DEVICE float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
TK_DEVICE float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
TK_DEVICE float lg2_approx(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// tanh in one MUFU instruction (absolute error about 2^-11: below bf16 rounding of the scores it caps).
TK_DEVICE float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace tk
