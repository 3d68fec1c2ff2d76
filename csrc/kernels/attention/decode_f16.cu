// The decode kernels for __half (decode.cuh): one translation unit per dtype, so that the two
// compile in parallel.
#include "decode.cuh"

namespace tk_attn {
template int decode_occupancy<__half>(int64_t, int);
template const char* decode_launch<__half>(const decode::Params&, int, cudaStream_t);
}  // namespace tk_attn
