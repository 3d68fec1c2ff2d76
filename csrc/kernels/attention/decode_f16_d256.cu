// The decode kernels for __half, head dim 256 (decode.cuh): one translation unit per (dtype, head dim),
// so that the six compile in parallel.
#include "decode.cuh"

namespace tk_attn {
template int decode_occupancy<__half, 256>(int);
template const char* decode_launch<__half, 256>(const decode::Params&, int, cudaStream_t);
}  // namespace tk_attn
