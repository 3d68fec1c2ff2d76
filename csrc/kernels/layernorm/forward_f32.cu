// The forward kernels for float x (forward.cuh).
#include "forward.cuh"

namespace tk_layernorm {
template cudaError_t forward_x<float>(const ForwardArgs& args, cudaStream_t stream);
}  // namespace tk_layernorm
