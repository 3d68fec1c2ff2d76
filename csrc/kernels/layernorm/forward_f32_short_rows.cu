// The forward kernels for float x, rows of hidden up to 2048 (forward.cuh).
#include "forward.cuh"

namespace tk_layernorm {
template cudaError_t forward_x<float, false, Rows::short_rows>(const ForwardArgs& args, cudaStream_t stream);
}  // namespace tk_layernorm
