// Launch interface of the layernorm family (torch-free; the binding includes it).
// h = residual + dropout(x), or h = x·silu(gate) (Mamba-2's gated norm); y = LayerNorm(h)·w + b, or RMSNorm
// y = h·rsqrt(mean(h²)+eps)·w.
// All tensors are row-major (rows, hidden), 16-byte aligned; absent optional tensors are nullptr.
// Arithmetic and statistics are fp32; each operand has its own dtype (DTypes).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace tk_layernorm {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };
constexpr int kMaxHidden = 16384;  // hidden % 8 == 0 and hidden <= kMaxHidden

// x: the input (and dx); h: the residual, h and dres (x's dtype when there is no residual); w: weight, bias, dw
// and db; y: the output and dy. The kernels take one dtype throughout, and the mixed recipes (supported()):
// an fp32 residual stream beside 16-bit branch outputs (autocast with fp32 parameters), fp32 weights on 16-bit
// activations, 16-bit weights and output on an fp32 h (a norm computed in fp32 and cast back), and the output
// cast to a 16-bit dtype (the cast fused).
struct DTypes {
  DType x, h, w, y;
};
bool supported(DTypes t);

// The gated norm h = x·silu(gate), computed in fp32 and never stored (the backward recomputes it from x and the
// gate). x and the gate are read and their gradients written in their own dtypes (any of DType, chosen at run
// time); the kernels are those of DTypes{f32, f32, w, y}, so w and y take what supported() takes for those.
bool gate_supported(DType w, DType y);

struct DropoutArgs {
  bool enabled = false;
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;  // min(floor(p * 2^32), 2^32 - 1)
  float scale = 1.f;       // 1 / (1 - p) in fp32
};

struct ForwardArgs {
  void* y;                 // (rows, hidden)
  void* h;                 // (rows, hidden) or nullptr: not written (plain norm: h == x)
  float* mean;             // (rows,) or nullptr (RMSNorm, or no statistics)
  float* rstd;             // (rows,) or nullptr: no statistics (inference: nothing will run the backward)
  const void* x;
  const void* residual;    // nullable
  const void* weight;      // (hidden,) nullable
  const void* bias;        // (hidden,) nullable
  const void* gate;        // (rows, hidden) nullable: h = x·silu(gate); no residual, no dropout, h not stored
  int64_t rows;
  int hidden;
  float eps;
  bool rms;
  DropoutArgs dropout;
  DTypes dtypes;           // with a gate: h is f32, x any dtype
  DType gate_dtype;
};

struct BackwardArgs {
  void* dres;              // (rows, hidden): d loss / d h (norm path + incoming dh), h's dtype
  void* dx;                // (rows, hidden): dres · mask · scale, or dres, in x's dtype; nullptr when dx is dres.
                           // With a gate: dres is nullptr (h's gradient is not kept) and dx = dres·silu(gate)
  void* dgate;             // (rows, hidden) with a gate: dres·x·silu'(gate), in the gate's dtype; else nullptr
  void* dw;                // (hidden,) or nullptr
  void* db;                // (hidden,) or nullptr
  float* partial;          // workspace: (2, backward_blocks, hidden) fp32
  const void* dy;
  const void* dy_more[2];  // nullable: further gradients of y, summed with dy in fp32 (autograd's sum of the
                           // gradients from the norm's several consumers, e.g. the q/k/v projections, fused)
  const void* dh;          // nullable: gradient arriving at h from its other uses
  const void* h;           // the normalised input (x when h was not stored, and always with a gate)
  const void* gate;        // nullable: h = x·silu(gate) is recomputed from x and the gate
  const void* weight;      // nullable
  const float* mean;       // nullptr for RMSNorm
  const float* rstd;
  int64_t rows;
  int hidden;
  bool rms;
  DropoutArgs dropout;
  DTypes dtypes;           // with a gate: as ForwardArgs
  DType gate_dtype;
};

// Forward: a row per block, two 8-element vectors per thread, the row in registers between its reductions and the
// normalisation (one pass over HBM).
cudaError_t forward(const ForwardArgs& args, cudaStream_t stream);

// Backward: a persistent grid whose blocks stage the next rows' dy, h and dh in shared memory (cp.async) while
// they reduce and write the current one, each block summing its rows' dw/db in registers into one partial row;
// then a column sum over the partial rows in a fixed order (deterministic). backward_blocks gives the grid for
// these args (all but `partial` filled in): `partial` holds 2 * blocks * hidden floats.
int backward_blocks(const BackwardArgs& args);
cudaError_t backward(const BackwardArgs& args, cudaStream_t stream);

}  // namespace tk_layernorm
