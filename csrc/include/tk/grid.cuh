// Grid helpers: persistent launch (one block per SM walking a task list) and an L2-friendly
// task order (supergroups of row tiles, walked column by column, so consecutive blocks share
// A rows and B columns while they are still in L2).
#pragma once
#include <cstdlib>

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

// Waves of a persistent grid (TK_GRID_WAVES, default 1). A persistent grid hands each block a fixed share of
// the work, sized to the SMs; a kernel running beside it (NCCL's all-reduce or all-gather on another stream,
// under DDP or FSDP) holds some SMs, and the blocks that do not fit wait to run their whole share after the
// others. k waves launch k times the blocks, each with 1/k of the share, so such a wait costs at most 1/k.
// Read on every launch (a benchmark switches it), clamped to [1, 4096].
inline int waves() {
    const char* s = std::getenv("TK_GRID_WAVES");
    if (s == nullptr || *s == '\0') return 1;
    const long k = std::strtol(s, nullptr, 10);
    return k < 1 ? 1 : (k > 4096 ? 4096 : int(k));
}

// Blocks for a persistent kernel over `tasks` tasks: one per SM and wave, never more than there are tasks.
inline int persistent_blocks(int tasks) {
    const int blocks = sm_count() * waves();
    return tasks < blocks ? (tasks > 0 ? tasks : 1) : blocks;
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

}  // namespace tk::grid
