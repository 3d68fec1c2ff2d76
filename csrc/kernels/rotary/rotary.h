// Launch interface of the rotary family (torch-free; the binding includes it).
// y = x·cos + rot(x)·sin on the first rotary_dim channels (rest copied), for up to two tensors (q, k)
// in one launch. rot is NeoX's rotate_half (cat(-x2, x1)) or GPT-J's interleaved pairs (-x[2i+1], x[2i]).
// backward = the transposed map: y = x·cos + rotᵀ(x·sin), which reads the partner channel's sin.
// Arithmetic is fp32; x, the cos/sin tables and y each have their own dtype (see supported()).
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
  DType in, tables, out;  // dtypes of x (q and k), cos/sin, y
};

// The dtype combinations the kernels take: one dtype throughout; 16-bit x with fp32 tables, writing fp32 (eager's
// promotion, as under autocast with fp32 tables) or x's dtype (that result cast back, the cast fused); fp32 x with
// fp32 tables writing 16-bit (the backward of the promoted forward: fp32 gradients, 16-bit input gradients).
bool supported(DType in, DType tables, DType out);

// The tile kernel (tile.cuh): a block owns (b, a few positions, a group of heads of q then k); each thread keeps its
// cos/sin in registers across those heads, with several heads' loads in flight. Shapes it does not cover (per-head
// tables, more than kMaxTileThreads units per position) run the row kernel (rows.cuh): a thread per
// (b, n, unit) walking the heads.
cudaError_t launch(const Args& args, cudaStream_t stream);

constexpr int kMaxTileThreads = 256;
// Whether every pointer, stride and size allows VEC-element accesses (and NeoX halves of whole VECs).
bool vectorizable(const Args& a, int vec);

}  // namespace tk_rotary
