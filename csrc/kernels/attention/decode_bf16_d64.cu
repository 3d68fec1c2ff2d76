// The decode kernels for __nv_bfloat16, head dim 64 (decode.cuh): one translation unit per (dtype, head dim),
// so that the six compile in parallel.
#include "decode.cuh"

namespace tk_attn {
template int decode_occupancy<__nv_bfloat16, 64>(int);
template const char* decode_launch<__nv_bfloat16, 64>(const decode::Params&, int, cudaStream_t);
}  // namespace tk_attn
