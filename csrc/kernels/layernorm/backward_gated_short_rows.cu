// The register-only backward kernels of the gated norm, h = x·silu(gate) recomputed in fp32, rows of hidden up to 2048
// (backward.cuh).
#include "backward.cuh"

namespace tk_layernorm {
template int registers_blocks_x<float, true, Rows::short_rows>(const BackwardArgs& args);
template cudaError_t registers_backward_x<float, true, Rows::short_rows>(const BackwardArgs& args, int blocks,
                                                              cudaStream_t stream);
}  // namespace tk_layernorm
