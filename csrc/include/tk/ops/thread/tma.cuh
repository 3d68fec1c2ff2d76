// TMA bulk tensor copies, issued by one thread. Coordinates are in units of the tile's rows and
// columns (coord.r * ST::rows, coord.c * ST::cols); a box that hangs over the view's edge reads
// zeros there (loads) or writes only the inside (stores), which is how kernels handle tails.
#pragma once
#include "../../types/gl.cuh"
#include "../../sync/semaphore.cuh"

namespace tk::tma {

template <shared_tile ST> TK_DEVICE void prefetch_map(const tma_map<ST>& m) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(&m.map) : "memory");
}

// Load tile at `at` into dst; completion is signalled (as bytes) on `bar`: pair with expect_bytes(bar, ST::bytes).
template <shared_tile ST> TK_DEVICE void load_async(ST& dst, const tma_map<ST>& m, semaphore& bar, coord at) {
    const uint32_t base = smem_addr(&dst), b = smem_addr(&bar);
#pragma unroll
    for (int blk = 0; blk < ST::cols / ST::block_cols; ++blk) {
        const int c = at.c * ST::cols + blk * ST::block_cols, r = at.r * ST::rows;
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
            ::"r"(base + blk * ST::rows * ST::block_cols * int(sizeof(typename ST::T))), "l"(&m.map), "r"(c), "r"(r),
             "r"(at.h), "r"(at.b), "r"(b)
            : "memory");
    }
}

// Store src to the tile at `at` (only its in-bounds part). Call fence_async_shared() and a barrier
// first when src was written by ordinary stores; then store_commit() and a store_wait*.
template <shared_tile ST> TK_DEVICE void store_async(const tma_map<ST>& m, const ST& src, coord at) {
    const uint32_t base = smem_addr(&src);
#pragma unroll
    for (int blk = 0; blk < ST::cols / ST::block_cols; ++blk) {
        const int c = at.c * ST::cols + blk * ST::block_cols, r = at.r * ST::rows;
        asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
                     ::"l"(&m.map), "r"(c), "r"(r), "r"(at.h), "r"(at.b),
                      "r"(base + blk * ST::rows * ST::block_cols * int(sizeof(typename ST::T)))
                     : "memory");
    }
}

TK_DEVICE void store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most N committed store groups are pending (fully written to global memory).
template <int N = 0> TK_DEVICE void store_wait() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }
// Wait until at most N groups still read their shared source (the source may then be reused).
template <int N = 0> TK_DEVICE void store_read_wait() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }

}  // namespace tk::tma
