// Launch interface of the rotary family (torch-free; the binding includes it).
// y = x·cos + rot(x)·sin on the first rotary_dim channels (rest copied), for up to two tensors (q, k)
// in one launch. rot is NeoX's rotate_half (cat(-x2, x1)) or GPT-J's interleaved pairs (-x[2i+1], x[2i]).
// backward = the transposed map: y = x·cos + rotᵀ(x·sin), which reads the partner channel's sin.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace tk_rotary {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

// One (B, H, N, D) tensor, any strides except a unit stride on D. cos/sin are indexed (b, h, n, j)
// with their own strides (0 where broadcast) and unit stride on j < rotary_dim.
struct Operand {
  void* out;
  const void* in;
  const void* cos;
  const void* sin;
  int64_t shape[3];       // B, H, N
  int64_t in_stride[3];
  int64_t out_stride[3];
  int64_t cs_stride[3];   // shared by cos and sin
};

struct Args {
  Operand ops[2];
  int count;              // 1 or 2 operands
  int head_dim;           // D
  int rotary_dim;         // even, <= D
  bool interleaved;
  bool backward;
};

cudaError_t launch(const Args& args, DType dtype, cudaStream_t stream);

}  // namespace tk_rotary
