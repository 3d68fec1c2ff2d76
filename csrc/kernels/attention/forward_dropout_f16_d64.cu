// The dropout forward kernels for __half, head dim 64, both masks (forward_launch.cuh): one
// translation unit per (dtype, head dim), so that they compile in parallel with the others.
#include "forward_launch.cuh"

namespace tk_attn {
template const char* forward_dropout_config<__half, 64>(DType, const View4&, const View4&, const View4&, void*,
                                                        float*, const Scores&, int, int*, cudaStream_t);
}  // namespace tk_attn
