// The forward kernels for __half, head dim 256, a causal mask (forward_kernels.cuh): one translation
// unit per (dtype, head dim, mask), so that the sixteen compile in parallel.
#include "forward_launch.cuh"

namespace tk_attn {
template const char* forward_config<__half, 256, true>(DType, const View4&, const View4&, const View4&,
                                                   void*, float*, const Scores&, int, int*, cudaStream_t);
}  // namespace tk_attn
