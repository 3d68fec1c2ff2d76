// The tile kernels for __half x (tile.cuh).
#include "tile.cuh"

namespace tk_rotary {
template cudaError_t launch_tile_x<__half>(const Args& args, cudaStream_t stream);
}  // namespace tk_rotary
