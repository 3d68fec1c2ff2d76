// The forward kernels for __nv_bfloat16, head dim 64, a causal mask (forward_kernels.cuh): one translation
// unit per (dtype, head dim, mask), so that the sixteen compile in parallel.
#include "forward_launch.cuh"

namespace tk_attn {
template const char* forward_config<__nv_bfloat16, 64, true>(DType, const View4&, const View4&, const View4&,
                                                   void*, float*, const Scores&, int, int*, cudaStream_t);
}  // namespace tk_attn
