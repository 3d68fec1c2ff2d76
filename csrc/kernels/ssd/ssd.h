// Launch interface of the ssd family (torch-free; the binding includes it). Mamba-2 SSD forward, per batch and
// head (tk_inductor/ops/ssd.py has the semantics):  h_t = exp(dt_t·A) h_{t-1} + dt_t · x_t B_tᵀ,  y_t = h_t C_t + D x_t.
// The binding hands the kernel one layout: x (b, l, nh, p) bf16, dt (b, l, nh) fp32, A (nh) fp32, B and C
// (b, l, ng, n) bf16, D (nh) fp32 or null, initial state (b, nh, p, n) fp32 or null, all contiguous; it writes
// y (b, l, nh, p) fp32 and the final state (b, nh, p, n) fp32, contiguous.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace tk_ssd {

constexpr int P_TILE = 64;  // p must be a multiple (blocks take 64 head dims, or 32 for small grids)

struct Args {
  const void* x;
  const float* dt;
  const float* A;
  const void* B;
  const void* C;
  const float* D;   // or nullptr
  const float* h0;  // or nullptr
  float* y;
  float* h_final;
  int b, l, nh, ng, p, n;
};
// The launch picks the kernel by the grid of 64-head-dim blocks (ssd.cu): at most half the SMs, 32 head dims per
// block (twice the blocks); one wave, one block per SM (178 registers at n 128); more, two blocks per SM (128
// registers, a few spilled).

// Whether the kernel computes this state size (n).
constexpr bool state_size_supported(int n) { return n == 64 || n == 128; }

// nullptr on success, else why not (a bad argument or a launch error).
const char* launch(const Args& a, cudaStream_t stream);

// Backward (ssd_backward.cu): from dy (b, l, nh, p) bf16 and dh (b, nh, p, n) fp32 (the final state's gradient, or
// null): dx = dt·dX + D·dy (X = dt·x; (b, l, nh, p) bf16), the gradients of B and C ((b, l, ng, n) fp32), the per-token
// sums dlam = C·dC_h − B·dB_h and xdX = Σ_p x·dX ((b, l, nh) fp32), dD = Σ x·dy ((nh) fp32, or null) and the initial
// state's gradient (dh0: (b, nh, p, n) fp32). Every output but dx and dh0 is zeroed by the caller: heads and head-dim
// tiles add into them. Inputs as Args.
struct BwdArgs {
  const void* x;
  const void* dy;
  const float* dt;
  const float* A;
  const void* B;
  const void* C;
  const float* h0;  // or nullptr
  const float* dh;  // or nullptr
  const float* D;  // (nh) or nullptr
  void* dx;
  float* dB;
  float* dC;
  float* dlam;
  float* xdX;
  float* dD;  // or nullptr
  float* dh0;
  void* chunk_states;  // bf16 (blocks, chunks, n·PT) scratch, b·nh·p·chunks·n in all: kernel A's chunk-end states
  float* anchor;       // (b, nh, chunks), zeroed: ⟨∂L/∂h, h⟩ at each chunk's end, for the dt/A gradients
  int b, l, nh, ng, p, n;
};
// 64 head dims per block, or 32 (twice the blocks) where the 64-wide grid fills at most half the SMs.
const char* launch_backward(const BwdArgs& a, cudaStream_t stream);

}  // namespace tk_ssd
