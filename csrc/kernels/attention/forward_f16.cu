// The forward kernels for __half (forward_kernels.cuh).
#include "forward_kernels.cuh"

namespace tk_attn {
template const char* forward_config<__half, 64>(DType, const View4&, const View4&, const View4&, void*, float*, bool,
                                               float, int, int*, cudaStream_t);
template const char* forward_config<__half, 128>(DType, const View4&, const View4&, const View4&, void*, float*, bool,
                                                float, int, int*, cudaStream_t);
}  // namespace tk_attn
