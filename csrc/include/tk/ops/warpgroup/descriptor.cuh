// wgmma shared-memory matrix descriptors: the fields are in 16-byte units, the start address in the low 14 bits.
#pragma once
#include "../../common.cuh"

namespace tk::desc {

TK_DEVICE uint64_t encode(uint64_t x) { return (x & 0x3FFFF) >> 4; }

// desc moved on by `bytes` (a multiple of 16). Shared addresses stay below 256 KB, so the start address never
// carries out of its field: a GEMM's k-steps cost one add each from one base descriptor, where re-encoding each
// step's address took ~8 instructions per wgmma, on the path between a wait and the next issue.
TK_DEVICE uint64_t add(uint64_t desc, uint32_t bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(desc) + (bytes >> 4));
}

// Byte offset of the k-th 16-deep slice of a GEMM operand stored as SW-byte swizzle spans of `rows` rows (the st
// layout, and the attention kernels' 64-wide panels): K-major (K along the columns) 32 bytes a slice within a span,
// spans rows * SW bytes apart; MN-major (K along the rows) 16 rows of one span.
template <int SW> TK_DEVICE constexpr uint32_t kmajor_offset(int k, int rows) {
    return (k % (SW / 32)) * 32 + (k / (SW / 32)) * rows * SW;
}
template <int SW> TK_DEVICE constexpr uint32_t mnmajor_offset(int k) { return k * 16 * SW; }

}  // namespace tk::desc
