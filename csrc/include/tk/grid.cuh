// Grid helpers: persistent launch (one block per SM walking a task list) and an L2-friendly
// task order (supergroups of row tiles, walked column by column, so consecutive blocks share
// A rows and B columns while they are still in L2).
#pragma once
#include <utility>

#include "common.cuh"

namespace tk::grid {

// Number of SMs of the current device (cached per device).
inline int sm_count() {
    static int cache[64] = {};
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 64 && cache[dev]) return cache[dev];
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (dev < 64) cache[dev] = n;
    return n;
}

// Blocks for a persistent kernel over `tasks` tasks: one per SM, never more than there are tasks.
inline int persistent_blocks(int tasks) {
    const int blocks = sm_count();
    return tasks < blocks ? (tasks > 0 ? tasks : 1) : blocks;
}

// Blocks of `blocks` that one wave holds at `per_sm` resident blocks per SM: ceil(blocks / (SMs · per_sm)).
inline long long waves_of(long long blocks, int per_sm) {
    const long long slots = (long long)sm_count() * per_sm;
    return slots > 0 ? (blocks + slots - 1) / slots : blocks;
}

struct tile_index {
    int row, col;
};

// Task -> (row tile, col tile) over a rows x cols grid of output tiles: tasks go down a
// supergroup of `group` row tiles before moving one column right. The last, shorter
// supergroup is handled exactly. Returns row = -1 past the end.
TK_HOST_DEVICE tile_index supergroup(int task, int rows, int cols, int group) {
    if (task >= rows * cols) return {-1, -1};
    const int per_group = group * cols, g = task / per_group, in_group = task % per_group;
    const int height = (g + 1) * group <= rows ? group : rows - g * group;
    return {g * group + in_group % height, in_group / height};
}

// Programmatic dependent launch. A kernel launched by `launch_dependent` may be scheduled while the stream's
// previous kernel drains (its launch latency and prologue overlap that kernel's tail); it must call
// `wait_prior_grid()` before it touches global memory, which returns once the previous kernel has finished and
// its writes are visible. On a plain launch the wait is a no-op.
__device__ __forceinline__ void wait_prior_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace tk::grid
