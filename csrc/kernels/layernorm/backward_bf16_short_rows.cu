// The register-only backward kernels for __nv_bfloat16 x, rows of hidden up to 2048 (backward.cuh).
#include "backward.cuh"

namespace tk_layernorm {
template int registers_blocks_x<__nv_bfloat16, false, Rows::short_rows>(const BackwardArgs& args);
template cudaError_t registers_backward_x<__nv_bfloat16, false, Rows::short_rows>(const BackwardArgs& args, int blocks,
                                                                  cudaStream_t stream);
}  // namespace tk_layernorm
