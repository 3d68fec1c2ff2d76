// Philox4x32-R, the counter-based generator of Salmon et al. (2011): four 32-bit random words from a 128-bit
// counter and a 64-bit key, a pure function, so a kernel's backward regenerates a dropout mask instead of storing
// it. R = 10 is the authors' default; they report 7 rounds already pass TestU01's BigCrush, the choice of a stream
// whose generator competes with the tensor cores for issue slots (attention). tk_inductor/ops/philox.py is the
// bit-identical PyTorch reference; each family defines its own stream (which counter an element uses) beside its
// kernels.
#pragma once
#include <cstdint>

#include "../../common.cuh"

namespace tk {

template <int ROUNDS>
TK_DEVICE uint4 philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

}  // namespace tk
