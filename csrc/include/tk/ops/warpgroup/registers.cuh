// Register reallocation between warpgroups (setmaxnreg): a producer warpgroup that only issues TMA gives registers
// back, and the consumers take them. Every warp of the warpgroup executes it; the counts are per thread, multiples
// of 8 in [24, 256].
#pragma once
#include "../../common.cuh"

namespace tk::warpgroup {

template <int R> TK_DEVICE void increase_registers() {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg takes multiples of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R> TK_DEVICE void decrease_registers() {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg takes multiples of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

}  // namespace tk::warpgroup
