// Backward, persistent kernel (backward_pipe.cuh) outside LEAN's hidden sizes, and the dispatch of both.
#include "backward_pipe.cuh"

namespace tk_layernorm {
namespace pipe {

int backward_blocks(const BackwardArgs& args) {
  return lean(args) ? pipe_lean::backward_blocks(args) : pipe_blocks<false>(args);
}

cudaError_t backward(const BackwardArgs& args, int blocks, cudaStream_t stream) {
  return lean(args) ? pipe_lean::backward(args, blocks, stream) : pipe_launch<false>(args, blocks, stream);
}

}  // namespace pipe
}  // namespace tk_layernorm
