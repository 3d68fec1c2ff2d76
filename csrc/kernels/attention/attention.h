// Torch-free interface of the attention kernels (used by binding.cpp).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace tk_attn {

enum class DType { bf16, f16 };

// Head dims the kernels take: multiples of 8 (16-byte rows for TMA), up to 256. The forward is compiled for D = 64,
// 128, 192 and 256, the backward for 64, 128 and 256; a smaller head dim runs on the next one up, whose tensor maps
// zero-fill the columns past it (zero columns of q and k add nothing to the scores, those of v give output columns that
// are never stored).
constexpr int64_t kMaxHeadDim = 256, kMaxBackwardHeadDim = 256;
inline bool head_dim_supported(int64_t d, int64_t max_d = kMaxHeadDim) { return d >= 8 && d <= max_d && d % 8 == 0; }

// A (B, H, S, D) view with element strides; the last dim is contiguous.
struct View4 {
  const void* ptr;
  int64_t B, H, S, D;
  int64_t sb, sh, ss;
};

// The score function: s = scale · q kᵀ; with softcap > 0, s = softcap · tanh(s / softcap) (Gemma-2); then, when
// causal, key j is hidden from query i unless j <= i (top-left), and with window > 0 also unless j > i - window
// (the sliding window as transformers builds it: each query sees itself and the window - 1 keys before it); with
// row_keys, query i of batch entry b also hides the keys outside the interval [x, y] = row_keys[b, i] (key-padding
// masks, packed sequences). A row that sees no key gets o = 0 and lse = +inf (SDPA's safe softmax; the backward's
// P = 0). The backward reads the same mask by keys: key_rows[b, j] = [x, y] are the queries whose interval holds j.
// Both tables are (B, rows, 2) int32, nondecreasing in x and in y along the rows (the kernels read a tile's range from
// its first and last rows); the forward takes row_keys, the backward key_rows.
// Dropout of the probabilities (training): P's element (b * Hq + h, i, j) is kept with probability 1 - p and scaled by
// 1 / (1 - p), by the Philox stream of dropout.cuh, a pure function of (seed, offset) and the element, so the backward
// regenerates the forward's mask. The forward's lse stays that of the undropped scores. Taken by the ping-pong forward
// (scale > 0, no softcap, head dims up to 128; never the decode kernels) and the D = 64 and 128 backward.
struct DropoutArgs {
  bool enabled = false;
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;  // min(floor(p * 2^32), 2^32 - 1); the kernels compare 16-bit halves with threshold >> 16
  float scale = 1.f;       // 1 / (1 - p) in fp32
};

struct Scores {
  bool causal;
  float scale;
  int window;     // 0: none; > 0 needs causal
  float softcap;  // 0: none
  const int* row_keys = nullptr;  // device, (B, N, 2); null: every key
  const int* key_rows = nullptr;  // device, (B, M, 2); null: every query
  DropoutArgs dropout = {};
  // backward: the gradient of lse, device (B, Hq, N) fp32; null: none (lse d/ds = P, so it enters as delta - grad_lse)
  const float* lse_grad = nullptr;
};

// Why `sc` is not a score function the kernels take, or nullptr.
inline const char* scores_error(const Scores& sc) {
  if (sc.window < 0 || (sc.window > 0 && !sc.causal)) return "a sliding window needs a causal mask";
  if (!(sc.softcap >= 0.f)) return "softcap must be >= 0";
  if (sc.dropout.enabled && (sc.softcap > 0.f || !(sc.scale > 0.f)))
    return "dropout runs with scale > 0 and without a softcap";
  return nullptr;
}

// The kernels' dropout: head dims up to this.
constexpr int64_t kMaxDropoutHeadDim = 128;

// o: (B, N, Hq, D) contiguous; lse: (B, Hq, N) fp32 contiguous. next_task: a zeroed device int, the counter of the
// dynamic schedule a causal mask runs (its tasks differ in length); unused without a mask (the static schedule: equal
// tasks, balanced by the static shares), where it may be null. Returns nullptr on success, else a static error
// string.
const char* attention_forward(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                              const Scores& sc, int num_sms, int* next_task, cudaStream_t stream);

// Queries of at most kDecodeRows rows (decode steps against a KV cache) run the split-KV kernels of decode.cu: the
// rows of a GQA group form one tile and the keys are split across CTAs until the grid fills the GPU; with more than
// one split, fp32 partials (normalised o and lse per row and split) are merged by a second kernel.
constexpr int64_t kDecodeRows = 16;
struct DecodePlan {
  int row_tiles, groups, splits, blocks_per_split;
  int64_t partial_floats, partial_rows;  // scratch for the partials' o and lse (0 with one split)
};
DecodePlan attention_decode_plan(DType dt, const View4& q, const View4& k, int num_sms);
// Same contract as attention_forward for q.S <= kDecodeRows; part_o / part_lse hold plan.partial_floats /
// plan.partial_rows floats (may be null when plan.splits == 1).
const char* attention_decode(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                             const Scores& sc, const DecodePlan& plan, float* part_o, float* part_lse,
                             cudaStream_t stream);

// Scratch sizes (bytes) the backward needs: fp32 dq accumulator, padded log2-domain lse and rowsum(do * o) (the
// backward's q tile for this head dim sets the padding).
struct BwdScratch {
  size_t dq_accum_bytes, lse2_bytes, delta_bytes;
};
BwdScratch attention_backward_scratch(const View4& q);

// dq (B,Hq,N,D), dk/dv (B,Hkv,M,D), written in their views' strides (16-byte aligned rows, strides multiples of 8
// elements). dq_accum needs no init (the pre-kernel zeroes it).
const char* attention_backward(DType dt, const View4& dout, const View4& q, const View4& k, const View4& v,
                               const View4& o, const float* lse, const View4& dq, const View4& dk, const View4& dv,
                               float* dq_accum, float* lse2, float* delta, const Scores& sc, int num_sms,
                               cudaStream_t stream);

}  // namespace tk_attn
