// Per-thread asynchronous copies global -> shared (cp.async, 16 or 4 bytes), for data whose rows are too short or
// too irregular for a TMA box (chunks of strided rows, zero-filled tails, per-thread staging). Completion is per
// thread by commit groups; a block barrier after the wait makes the data visible to the other threads.
// Shared memory is addressed by 32-bit shared-window address.
#pragma once
#include "../../common.cuh"

namespace tk {

TK_DEVICE void cp_async16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// With valid = false, 16 zero bytes instead (src is not read but must be a mapped address).
TK_DEVICE void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// 4 bytes (e.g. one fp32 of a strided row).
TK_DEVICE void cp_async4(uint32_t dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
TK_DEVICE void cp_async4(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
TK_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's commit groups are still in flight.
template <int N = 0> TK_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

}  // namespace tk
