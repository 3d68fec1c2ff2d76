// Backward, persistent kernel (backward_pipe.cuh) with LEAN, at hidden 513..4096 (backward_pipe.cu dispatches here).
#include "backward_pipe.cuh"

namespace tk_layernorm {
namespace pipe_lean {

int backward_blocks(const BackwardArgs& args) { return pipe_blocks<true>(args); }

cudaError_t backward(const BackwardArgs& args, int blocks, cudaStream_t stream) {
  return pipe_launch<true>(args, blocks, stream);
}

}  // namespace pipe_lean
}  // namespace tk_layernorm
