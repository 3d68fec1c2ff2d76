// Thread-block clusters (sm_90): the blocks of a cluster run at the same time on one GPC and can read each
// other's shared memory (distributed shared memory). A kernel launched with a cluster shape (see
// tk::grid::launch_dependent's `cluster` argument) uses these to combine per-block results before one
// global write, instead of every block writing its own.
#pragma once
#include "../common.cuh"

namespace tk::cluster {

// This block's rank in its cluster, the cluster's blocks, and the cluster's index in the grid (x only:
// the kernels here use 1-D clusters of 1-D grids).
TK_DEVICE uint32_t rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
TK_DEVICE uint32_t size() {
    uint32_t n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
    return n;
}
TK_DEVICE uint32_t id() {
    uint32_t c;
    asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(c));
    return c;
}

// Every thread of every block of the cluster arrives and waits. Release/acquire: shared-memory writes made
// before it are visible to the other blocks' reads after it. A block must not exit while another may still
// read its shared memory, so a read phase ends with one more sync().
TK_DEVICE void sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address in block `r`'s shared memory of what is at `smem` (a shared-window address) in this block's.
TK_DEVICE uint32_t map(uint32_t smem, uint32_t r) {
    uint32_t out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem), "r"(r));
    return out;
}

// 16 bytes from a mapped (cluster-window) shared-memory address.
TK_DEVICE float4 load4(uint32_t cluster_smem) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(cluster_smem)
                 : "memory");
    return v;
}

}  // namespace tk::cluster
