// The layernorm family's dropout stream on tk::philox4x32<10>, bit-identical to tk_inductor/ops/philox.py.
// Element e of the flattened (rows, hidden) tensor uses word e % 4 of
// philox(key = seed, counter = (e / 4, offset)); it is kept iff word >= threshold.
#pragma once
#include <cstdint>

#include "tk/ops/thread/philox.cuh"

namespace tk_layernorm {

struct Dropout {
  uint64_t seed, offset;
  uint32_t threshold;  // keep iff word >= threshold
  float scale;         // 1 / (1 - p), rounded to fp32 on the host

  // Keep bits (bit i = element first + i) for 8 consecutive elements; first % 4 == 0.
  __device__ __forceinline__ uint32_t keep8(uint64_t first) const {
    uint32_t bits = 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint64_t g = (first >> 2) + half;
      const uint4 w = tk::philox4x32<10>(make_uint4(uint32_t(g), uint32_t(g >> 32), uint32_t(offset), uint32_t(offset >> 32)),
                                    uint32_t(seed), uint32_t(seed >> 32));
      bits |= (uint32_t(w.x >= threshold) | uint32_t(w.y >= threshold) << 1 | uint32_t(w.z >= threshold) << 2 |
               uint32_t(w.w >= threshold) << 3) << (4 * half);
    }
    return bits;
  }
};

}  // namespace tk_layernorm
