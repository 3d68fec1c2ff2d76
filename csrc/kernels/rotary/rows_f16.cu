// The row kernels for __half x (rows.cuh).
#include "rows.cuh"

namespace tk_rotary {
template cudaError_t launch_rows_x<__half>(const Args& args, cudaStream_t stream);
}  // namespace tk_rotary
