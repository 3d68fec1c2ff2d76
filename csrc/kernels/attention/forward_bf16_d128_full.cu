// The forward kernels for __nv_bfloat16, head dim 128, no mask (forward_kernels.cuh): one translation
// unit per (dtype, head dim, mask), so that the sixteen compile in parallel.
#include "forward_launch.cuh"

namespace tk_attn {
template const char* forward_config<__nv_bfloat16, 128, false>(DType, const View4&, const View4&, const View4&,
                                                   void*, float*, const Scores&, int, int*, cudaStream_t);
}  // namespace tk_attn
