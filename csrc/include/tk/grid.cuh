// Grid helpers: persistent launch (one block per SM walking a task list) and an L2-friendly
// task order (supergroups of row tiles, walked column by column, so consecutive blocks share
// A rows and B columns while they are still in L2).
#pragma once
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
    const int sms = sm_count();
    return tasks < sms ? (tasks > 0 ? tasks : 1) : sms;
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
