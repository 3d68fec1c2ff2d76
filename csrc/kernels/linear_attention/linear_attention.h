// Launch interface of the linear_attention family (torch-free; the binding includes it).
// Based (2nd-order Taylor) and plain (identity, elu + 1) causal linear attention.
// Based, forward:
//   o_i = Σ_{j≤i} κ(q_i, k_j) v_j  [/ (Σ_{j≤i} κ(q_i, k_j) + eps) when normalize],  κ = 1 + s + s²/2, s = scale·q_i·k_j
// q, k: (B, H, N, 16); v: (B, H, N, dv), dv a multiple of 64; o: (B, H, N, dv) contiguous; bf16.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace tk_linear_attention {

constexpr int BASED_DK = 16;     // feature dim of q and k (the Based paper's; the φ of size 1 + 16 + 256 is built on the fly)
constexpr int VALUE_TILE = 64;  // value columns per block, Based and plain kernels: dv must be a multiple

struct BasedArgs {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int B, H, N, dv;
  int64_t q_stride[3], k_stride[3], v_stride[3];  // (b, h, n) in elements; the last dim has unit stride
  float scale;
  bool normalize;
  float eps;
};
// One warpgroup per (batch·head, 64 value columns), two blocks per SM (based.cu).

// nullptr on success, else why not (a bad argument or a launch error).
const char* launch_based(const BasedArgs& a, cudaStream_t stream);

// Based backward: dq, dk (fp32, zeroed by the caller: value tiles add into them) and dv from do.
// dout, o: (B, H, N, dv) bf16 contiguous (o: normalising only); delta: (B, H, N) fp32 scratch the launch fills with
// do·o per row (null without normalising);
// dq, dk: (B, H, N, 16) fp32; dv_out: (B, H, N, dv) bf16 contiguous.
struct BasedBwdArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const void* o;  // the forward's output (B, H, N, dv) bf16 contiguous, for delta
  float* delta;   // (B, H, N) scratch: do·o per row (normalised only)
  float* dq;
  float* dk;
  void* dv_out;
  int B, H, N, dv;
  int64_t q_stride[3], k_stride[3], v_stride[3];
  float scale;
  bool normalize;
  float eps;
};
// Blocks of 64 value columns, as the forward's (based_backward.cu launches the two scans).
const char* launch_based_backward(const BasedBwdArgs& a, cudaStream_t stream);

// Plain feature maps: o_i = scale Σ_{j≤i} (φq_i·φk_j) v_j [/ (scale Σ_{j≤i} φq_i·φk_j + eps) when normalize], with
// φ applied to q and k element by element (identity, elu + 1: q, k (B, H, N, dk), dk 64 or 128, the features q's and
// k's own columns) or Hedgehog's φ_W(x) = cat(softmax(x W), softmax(-x W)) over F/2 projections (q, k (B, H, N, dk),
// dk 64 or 128; F 64 or 128 features; W per head or shared); v as Based's; bf16.
enum class FeatureMap : int { identity = 0, elu1 = 1, hedgehog = 2 };  // φ(x) = x; elu(x) + 1; Hedgehog's
constexpr int PLAIN_DK[2] = {64, 128};  // q/k columns, every map; and the feature count F
struct PlainArgs : BasedArgs {
  int features;  // F: dk for the elementwise maps, 2 × the projections for Hedgehog
  int dk;        // q's and k's columns
  FeatureMap map;
  // Hedgehog: Wᵀ of q and k, (weight_heads, F/2, dk) bf16 contiguous; weight_heads 1 (shared) or H
  const void* q_weight_t = nullptr;
  const void* k_weight_t = nullptr;
  int weight_heads = 0;
};
// One warpgroup per (batch·head, 64 value columns) (plain.cu; Hedgehog's instances in hedgehog.cu).
const char* launch_plain(const PlainArgs& a, cudaStream_t stream);
const char* launch_hedgehog(const PlainArgs& a, cudaStream_t stream);

// Hedgehog's feature map on its own, for the backward (the forward computes it inside the scan), one warpgroup per
// (batch·head, 64 rows) (hedgehog_map.cu). x: (B, H, N, dk) with strides; Wᵀ as PlainArgs'. Features: φ (B, H, N, F)
// into `features`. Backward: from dφ (B, H, N, F) in `features`, dx (B, H, N, dk) and dz = dφ's gradient of x W
// (B, H, N, F/2, for the weight's gradient Σ xᵀ dz). All bf16, the outputs and dφ contiguous.
struct HedgehogMapArgs {
  const void* x;
  int64_t x_stride[3];
  const void* weight_t;
  int weight_heads;
  void* features;
  void* dx;
  void* dz;
  int B, H, N, dk, F;
};
const char* launch_hedgehog_features(const HedgehogMapArgs& a, cudaStream_t stream);
const char* launch_hedgehog_features_backward(const HedgehogMapArgs& a, cudaStream_t stream);

// Plain backward: as Based's (delta filled by the launch), dq and dk (B, H, N, dk) either fp32 and zeroed by the
// caller (dv > 64: value tiles add into them) or, at dv 64, null with dq_out and dk_out bf16 outputs; and ksum:
// (B, H, ceil(N / 64), dk) fp32 scratch for each chunk's Σ φk (normalising only).
struct PlainBwdArgs : BasedBwdArgs {
  int features;  // dk
  FeatureMap map;
  float* ksum;
  void* dq_out;
  void* dk_out;
};
const char* launch_plain_backward(const PlainBwdArgs& a, cudaStream_t stream);

}  // namespace tk_linear_attention
