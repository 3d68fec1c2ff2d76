// TMA bulk tensor copies, issued by one thread. Coordinates are in units of the tile's rows and
// columns (coord.r * ST::rows, coord.c * ST::cols); a box that hangs over the view's edge reads
// zeros there (loads) or writes only the inside (stores), which is how kernels handle tails.
#pragma once
#include "../../types/gl.cuh"
#include "../../sync/semaphore.cuh"

namespace tk::tma {

// Raw forms, on a CUtensorMap and coordinates in elements (innermost first), for kernels that lay their shared
// tiles out themselves (the attention kernels' 64-column panels). The typed forms below are these on a tile.
TK_DEVICE void prefetch_map(const CUtensorMap* map) { asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory"); }
// Box at (c0, c1, c2, c3) into dst; completion (as bytes) on `bar`. Rows outside the tensor read as zero.
TK_DEVICE void load_async(void* dst, const CUtensorMap* map, semaphore& bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
                 ::"r"(smem_addr(dst)), "l"(map), "r"(smem_addr(&bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) from global src into dst, no tensor
// map; completion (as bytes) on `bar`. (compute-sanitizer's racecheck attributes this copy's write to the issuing
// thread and does not see the semaphore order it, so it reports a ring of these as races; tensor copies it follows.)
TK_DEVICE void load_bytes_async(void* dst, const void* src, uint32_t bytes, semaphore& bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(&bar)) : "memory");
}
// src to the box at (c0, c1, c2, c3), only its part inside the tensor; a bulk group (store_commit, store_*wait).
TK_DEVICE void store_async(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 ::"l"(map), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// The same if pred, predicated (no branch: code that runs while a wgmma is in flight must not branch).
TK_DEVICE void store_async_if(bool pred, const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %6, 0;\n"
                 "@p cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1]; }"
                 ::"l"(map), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(int(pred)) : "memory");
}
// Element-wise fp32 add of src into the box at (c0, c1, c2), done by the TMA unit; a bulk group.
TK_DEVICE void reduce_add_async(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
                 ::"l"(map), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

template <shared_tile ST> TK_DEVICE void prefetch_map(const tma_map<ST>& m) { prefetch_map(&m.map); }

// Load tile at `at` into dst; completion is signalled (as bytes) on `bar`: pair with expect_bytes(bar, ST::bytes).
template <shared_tile ST> TK_DEVICE void load_async(ST& dst, const tma_map<ST>& m, semaphore& bar, coord at) {
    constexpr int block_bytes = ST::rows * ST::block_cols * int(sizeof(typename ST::T));
#pragma unroll
    for (int blk = 0; blk < ST::cols / ST::block_cols; ++blk)
        load_async(reinterpret_cast<char*>(&dst) + blk * block_bytes, &m.map, bar, at.c * ST::cols + blk * ST::block_cols,
                   at.r * ST::rows, at.h, at.b);
}

// Store src to the tile at `at` (only its in-bounds part). Call fence_async_shared() and a barrier
// first when src was written by ordinary stores; then store_commit() and a store_wait*.
template <shared_tile ST> TK_DEVICE void store_async(const tma_map<ST>& m, const ST& src, coord at) {
    constexpr int block_bytes = ST::rows * ST::block_cols * int(sizeof(typename ST::T));
#pragma unroll
    for (int blk = 0; blk < ST::cols / ST::block_cols; ++blk)
        store_async(&m.map, reinterpret_cast<const char*>(&src) + blk * block_bytes, at.c * ST::cols + blk * ST::block_cols,
                    at.r * ST::rows, at.h, at.b);
}

TK_DEVICE void store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
TK_DEVICE void store_commit_if(bool pred) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p cp.async.bulk.commit_group; }" ::"r"(int(pred)) : "memory");
}
// Wait until at most N committed store groups are pending (fully written to global memory).
template <int N = 0> TK_DEVICE void store_wait() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }
// Wait until at most N groups still read their shared source (the source may then be reused).
template <int N = 0> TK_DEVICE void store_read_wait() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
TK_DEVICE void store_read_wait_if(bool pred) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %0, 0; @p cp.async.bulk.wait_group.read 0; }" ::"r"(int(pred)) : "memory");
}

}  // namespace tk::tma
