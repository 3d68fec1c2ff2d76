// The row kernels for __nv_bfloat16 x (rows.cuh).
#include "rows.cuh"

namespace tk_rotary {
template cudaError_t launch_rows_x<__nv_bfloat16>(const Args& args, cudaStream_t stream);
}  // namespace tk_rotary
