// The split-KV decode kernels' constants and launch parameters (decode.cuh holds the kernels, decode.cu the plan).
#pragma once
#include <cstdint>

#include "attention.h"

namespace tk_attn {
namespace decode {

constexpr int BK = 64;       // keys per ring stage
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
// Three stages: two CTAs per SM at D = 128, faster on the H200 than one CTA with a deeper ring (RESULTS.md).
constexpr int STAGES = 3;
constexpr int GROUP_ROWS = 64;  // query rows per CTA (4 row tiles)
constexpr int MAX_SPLITS = 1024;  // key splits per row group at most (the merge keeps a row's weights in shared memory)
constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

// Query row r of a (b, kv head) group is query head hkv·G + r / N, position r % N.
struct Rows {
  int G, N, R;  // R = G·N
};

struct Params {
  View4 q, k, v;
  void* o;             // (B, N, Hq, D) contiguous
  float* lse;          // (B, Hq, N)
  float* part_o;       // (pairs, splits, 16·RT, D) fp32, when splits > 1
  float* part_lse;     // (pairs, splits, 16·RT)
  Scores sc;
  Rows rows;
  int groups;          // row groups per (b, kv head)
  int splits, blocks_per_split;
};

}  // namespace decode

// Resident CTAs per SM of the kernel for (T, head dim DK, row tiles), 0 if it cannot run; and its launch (with the
// merge of several splits). Defined in decode.cuh, instantiated per dtype and DK in decode_<dtype>_d<DK>.cu, so that
// the six compile in parallel; a head dim d runs on the next DK of 64, 128 and 256 (zero-filled past d).
template <typename T, int DK>
int decode_occupancy(int row_tiles);
template <typename T, int DK>
const char* decode_launch(const decode::Params& p, int row_tiles, cudaStream_t stream);

}  // namespace tk_attn
