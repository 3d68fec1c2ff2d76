// The tile kernels for float x (tile.cuh).
#include "tile.cuh"

namespace tk_rotary {
template cudaError_t launch_tile_x<float>(const Args& args, cudaStream_t stream);
}  // namespace tk_rotary
