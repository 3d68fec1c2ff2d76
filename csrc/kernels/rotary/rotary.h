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

// Kernel variants, chosen at run time so that one device run can compare them (tk_cuda::rotary_variant).
// Variant 0 is the first kernel (a thread per (b, n, unit) walking one tensor's heads, q and k in separate
// block ranges), kept so a regression can be undone by flipping kDefaultVariant. The others are the tile
// kernel (tile.cu): a block owns (b, a few positions, a group of heads_per_thread heads of q then k); each
// thread keeps its cos/sin in registers across those heads and has heads_in_flight heads' loads (two
// VEC-wide packs each) issued before its first store. heads_per_thread 0 = all heads of q and k.
// Names: f = heads in flight, h = heads per thread (all), t = threads per block.
struct Variant {
  const char* name;
  int heads_in_flight;    // 2 or 4 (compile-time in the kernel); 0 = the first kernel
  int heads_per_thread;   // 0 = every head
  int threads;            // per block (<= kMaxTileThreads)
  bool stream;            // evict-first loads/stores of q/k (cos/sin keep L2)
};

constexpr int kMaxTileThreads = 256;
constexpr Variant kVariants[] = {
    {"legacy", 0, 0, 0, false},
    {"tile f2 hall t256", 2, 0, 256, false},
    {"tile f4 h8 t128", 4, 8, 128, false},
    {"tile f4 h16 t128", 4, 16, 128, false},
    {"tile f4 h8 t128 stream", 4, 8, 128, true},
    {"tile f2 h4 t128", 2, 4, 128, false},
    {"tile f4 h4 t128", 4, 4, 128, false},
    {"tile f4 hall t128", 4, 0, 128, false},
    {"tile f2 h8 t128", 2, 8, 128, false},
    {"tile f4 h8 t256", 4, 8, 256, false},
};
constexpr int kVariantCount = int(sizeof(kVariants) / sizeof(kVariants[0]));
// Best guess before measuring: small blocks (short tail), 128 bytes of loads in flight per thread.
constexpr int kDefaultVariant = 6;  // best worst-case ratio in the 2026-11-29 H200 sweep (RESULTS.md)

// Any variant runs every valid input: the tile kernel hands shapes it does not cover (more than
// kMaxTileThreads units per position) to the first kernel.
cudaError_t launch(const Args& args, DType dtype, cudaStream_t stream, int variant = kDefaultVariant);

// The two kernels (rotary.cu, tile.cu). launch_tile returns cudaErrorNotSupported for shapes it leaves to launch_legacy.
cudaError_t launch_legacy(const Args& args, DType dtype, cudaStream_t stream);
cudaError_t launch_tile(const Args& args, DType dtype, cudaStream_t stream, const Variant& v);
// Whether every pointer, stride and size allows VEC-element accesses (and NeoX halves of whole VECs).
bool vectorizable(const Args& a, int vec, int elem_bytes);

}  // namespace tk_rotary
