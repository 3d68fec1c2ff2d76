// The persistent backward kernels for __nv_bfloat16 x, outside LEAN's hidden sizes (backward_pipe.cuh).
#include "backward_pipe.cuh"

namespace tk_layernorm {
template int pipe_blocks_x<__nv_bfloat16, false>(const BackwardArgs& args);
template cudaError_t pipe_backward_x<__nv_bfloat16, false>(const BackwardArgs& args, int blocks, cudaStream_t stream);
}  // namespace tk_layernorm
