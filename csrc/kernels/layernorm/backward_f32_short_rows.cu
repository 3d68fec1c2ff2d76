// The register-only backward kernels for float x, rows of hidden up to 2048 (backward.cuh).
#include "backward.cuh"

namespace tk_layernorm {
template int registers_blocks_x<float, false, Rows::short_rows>(const BackwardArgs& args);
template cudaError_t registers_backward_x<float, false, Rows::short_rows>(const BackwardArgs& args, int blocks,
                                                                  cudaStream_t stream);
}  // namespace tk_layernorm
