// Attention for short queries: the split plan and the dispatch on dtype to the split-KV kernels of decode.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>

#include "decode.h"

namespace tk_attn {

using namespace decode;

namespace {
// f.template operator()<T, DK>() for the dtype and the kernels' head dim of d (the next of 64, 128 and 256).
template <class F>
auto by_kernel(DType dt, int64_t d, F&& f) {
  const auto dk = [&]<typename T>() {
    return d > 128 ? f.template operator()<T, 256>() : d > 64 ? f.template operator()<T, 128>()
                                                              : f.template operator()<T, 64>();
  };
  return dt == DType::bf16 ? dk.template operator()<__nv_bfloat16>() : dk.template operator()<__half>();
}
}  // namespace

DecodePlan attention_decode_plan(DType dt, const View4& q, const View4& k, int num_sms) {
  DecodePlan plan{};
  const int64_t G = q.H / k.H, R = G * q.S;
  const int64_t tiles = (std::min<int64_t>(R, GROUP_ROWS) + 15) / 16;
  plan.row_tiles = tiles == 1 ? 1 : tiles == 2 ? 2 : 4;
  plan.groups = int((R + GROUP_ROWS - 1) / GROUP_ROWS);
  const int64_t pairs = q.B * k.H * plan.groups, blocks = std::max<int64_t>(1, (k.S + BK - 1) / BK);
  const int per_sm = by_kernel(dt, q.D, [&]<typename T, int DK>() { return decode_occupancy<T, DK>(plan.row_tiles); });
  const int64_t slots = std::max<int64_t>(1, int64_t(per_sm) * num_sms);
  // Splits: the fewest waves times the longest CTA (its blocks plus about one block of fixed work).
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t s = 1; s <= std::min<int64_t>(blocks, MAX_SPLITS); ++s) {
    const int64_t per = (blocks + s - 1) / s;
    if ((blocks + per - 1) / per != s) continue;  // another s gives the same blocks per split
    const int64_t cost = ((pairs * s + slots - 1) / slots) * (per + 1);
    if (cost < best_cost) best = s, best_cost = cost;
  }
  plan.splits = int(best);
  plan.blocks_per_split = int((blocks + best - 1) / best);
  const int64_t rows = pairs * plan.splits * 16 * plan.row_tiles;
  plan.partial_rows = plan.splits > 1 ? rows : 0;
  plan.partial_floats = plan.splits > 1 ? rows * q.D : 0;
  return plan;
}

const char* attention_decode(DType dt, const View4& q, const View4& k, const View4& v, void* o, float* lse,
                             const Scores& sc, const DecodePlan& plan, float* part_o, float* part_lse,
                             cudaStream_t stream) {
  if (const char* e = scores_error(sc)) return e;
  if (!head_dim_supported(q.D)) return "head dim must be a multiple of 8 up to 256";
  if (q.S > kDecodeRows) return "the decode kernel takes at most kDecodeRows query rows";
  if (plan.splits > 1 && (part_o == nullptr || part_lse == nullptr)) return "the decode plan needs partials";
  const Params p{q, k, v, o, lse, part_o, part_lse, sc, Rows{int(q.H / k.H), int(q.S), int(q.H / k.H * q.S)},
                 plan.groups, plan.splits, plan.blocks_per_split};
  return by_kernel(dt, q.D, [&]<typename T, int DK>() { return decode_launch<T, DK>(p, plan.row_tiles, stream); });
}

}  // namespace tk_attn
