// Launch interface of the ssd family (torch-free; the binding includes it). Mamba-2 SSD forward, per batch and
// head (tk_inductor/ops/ssd.py has the semantics):  h_t = exp(dt_t·A) h_{t-1} + dt_t · x_t B_tᵀ,  y_t = s·h_t C_t + D x_t
// (s = y_scale, 1 for the SSD). Without A the same kernels compute simple GLA (tk_inductor/ops/simple_gla.py): dt is
// then the log decay itself and x enters unscaled, h_t = exp(dt_t) h_{t-1} + x_t B_tᵀ (q = C, k = B, v = x, g = dt).
// The binding hands the forward one layout: x (b, l, nh, p) bf16, dt as (b, nh, l_pad) fp32 (the sequence innermost,
// zero past l, l_pad a multiple of 64), A (nh) fp32, B and C (b, l, ng, n) bf16, D (nh) fp32 or null, initial state
// (b, nh, p, n) fp32 or null, all contiguous; it writes y (b, l, nh, p) in bf16 (y_bf16) or fp32 and the final
// state (b, nh, p, n) fp32, contiguous.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace tk_ssd {

constexpr int P_TILE = 64;  // p must be a multiple (the forward's tasks take 64 head dims; the backward 64 or 32)

struct Args {
  const void* x;
  const float* dt;  // (b, nh, l_pad)
  const float* A;   // or nullptr: simple GLA
  const void* B;
  const void* C;
  const float* D;   // or nullptr
  const float* h0;  // or nullptr
  void* y;
  bool y_bf16;
  float y_scale;  // s above
  float* h_final;
  int b, l, l_pad, nh, ng, p, n;
  // Sequences split into `segments` segments of chunks (scan_segments; 1: none) need fp32 scratch for each
  // segment's state from zero, seg_states (b, nh, segments, p, n), and its total decay, seg_decay (b, nh, segments).
  int segments;
  float* seg_states;
  float* seg_decay;
};

// Whether the kernel computes this state size (n).
constexpr bool state_size_supported(int n) { return n == 16 || n == 32 || n == 64 || n == 128; }

// Forward (ssd.cu). nullptr on success, else why not (a bad argument or a launch error).
const char* launch(const Args& a, cudaStream_t stream);
// The segments per sequence a scan (the forward, each backward kernel) runs best with on the current device: more
// than one when the (batch, group, head pair, head-dim tile) tasks leave SMs idle (a first pass then gives each
// segment's state from zero, and each segment's task starts from the state carried across the segments before it).
int scan_segments(int b, int l, int nh, int ng, int p);

// Backward (ssd_backward.cu): from dy (b, l, nh, p) bf16 and dh (b, nh, p, n) fp32 (the final state's gradient, or
// null): dx = dt·dX + D·dy (X = dt·x; (b, l, nh, p) bf16), the gradients of B and C ((b, l, ng, n) fp32), the per-token
// sums dlam = C·dC_h − B·dB_h and xdX = Σ_p x·dX ((b, l, nh) fp32, or null), dD = Σ x·dy ((nh) fp32, or null) and the
// initial state's gradient (dh0: (b, nh, p, n) fp32). The forward's y_scale is not applied: scale dy by it first. Every output but dx and dh0 is zeroed by the caller: heads and head-dim
// tiles add into them. Inputs as the forward's.
struct BwdArgs {
  const void* x;
  const void* dy;
  const float* dt;  // (b, nh, l_pad)
  const float* A;   // or nullptr: simple GLA
  const void* B;
  const void* C;
  const float* h0;  // or nullptr
  const float* dh;  // or nullptr
  const float* D;  // (nh) or nullptr
  void* dx;
  float* dB;
  float* dC;
  float* dlam;
  float* xdX;  // or nullptr
  float* dD;  // or nullptr
  float* dh0;
  void* chunk_states;  // bf16 scratch of b·nh·p·chunks·n (16-byte aligned): each chunk's end state, from kernel A
  float* anchor;       // (b, nh, chunks), zeroed: ⟨∂L/∂h, h⟩ at each chunk's end, for the dt/A gradients
  int b, l, l_pad, nh, ng, p, n;
  // as Args: split sequences (scan_segments) need each segment's state from zero for h (seg_states) and for ∂L/∂h
  // (seg_grads), both (b, nh, segments, p, n) fp32, and its decay, seg_decay (b, nh, segments) fp32
  int segments;
  float* seg_states;
  float* seg_grads;
  float* seg_decay;
};
const char* launch_backward(const BwdArgs& a, cudaStream_t stream);

}  // namespace tk_ssd
