// The forward kernels for __nv_bfloat16 x, rows of hidden up to 2048 (forward.cuh).
#include "forward.cuh"

namespace tk_layernorm {
template cudaError_t forward_x<__nv_bfloat16, false, Rows::short_rows>(const ForwardArgs& args, cudaStream_t stream);
}  // namespace tk_layernorm
