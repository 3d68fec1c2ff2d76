// The decode kernels for __half, head dim 128 (decode.cuh): one translation unit per (dtype, head dim),
// so that the six compile in parallel.
#include "decode.cuh"

namespace tk_attn {
template int decode_occupancy<__half, 128>(int);
template const char* decode_launch<__half, 128>(const decode::Params&, int, cudaStream_t);
}  // namespace tk_attn
