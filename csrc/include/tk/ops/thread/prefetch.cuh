// Bulk prefetch of global memory into L2 (Hopper's cp.async.bulk.prefetch), issued by one thread: a kernel that
// walks rows in a loop asks for its next rows while it works on the current ones, so their loads hit L2 instead of
// waiting on HBM. No registers, no shared memory, no completion to wait for.
#pragma once
#include <cstdint>

#include "../../common.cuh"

namespace tk {

// `bytes` from `src` (both multiples of 16).
TK_DEVICE void prefetch_l2(const void* src, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

}  // namespace tk
