// The tile kernels for __nv_bfloat16 x (tile.cuh).
#include "tile.cuh"

namespace tk_rotary {
template cudaError_t launch_tile_x<__nv_bfloat16>(const Args& args, cudaStream_t stream);
}  // namespace tk_rotary
