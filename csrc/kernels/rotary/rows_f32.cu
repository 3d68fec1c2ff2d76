// The row kernels for float x (rows.cuh).
#include "rows.cuh"

namespace tk_rotary {
template cudaError_t launch_rows_x<float>(const Args& args, cudaStream_t stream);
}  // namespace tk_rotary
