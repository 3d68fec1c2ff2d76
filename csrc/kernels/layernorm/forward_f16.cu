// The forward kernels for __half x (forward.cuh).
#include "forward.cuh"

namespace tk_layernorm {
template cudaError_t forward_x<__half>(const ForwardArgs& args, cudaStream_t stream);
}  // namespace tk_layernorm
