// The forward kernels of the gated norm, h = x·silu(gate) recomputed in fp32, rows of hidden over 2048 (forward.cuh).
#include "forward.cuh"

namespace tk_layernorm {
template cudaError_t forward_x<float, true, Rows::long_rows>(const ForwardArgs& args, cudaStream_t stream);
}  // namespace tk_layernorm
