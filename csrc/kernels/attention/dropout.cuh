// Attention dropout on tk::philox4x32<7> (seven rounds: see tk/ops/thread/philox.cuh): the probabilities
// P = softmax(s) are multiplied by keep / (1 - p), with keep a pure function of (seed, offset, query head bh = b * Hq + h, query i, key j), so the backward regenerates
// the mask instead of storing it. tk_inductor/ops/philox.py (`attention_keep_mask`) is the bit-identical reference.
//
// The stream: one generator call, philox(key = seed, counter = (jg, ig, bh, offset mod 2^32)), serves the eight
// elements {i, i + 8} x {j, j + 1, j + 8, j + 9} (i % 16 < 8, j % 16 < 8, j even): ig = (i / 16) * 8 + i % 8,
// jg = (j / 16) * 4 + (j % 8) / 2. Element (i, j) takes 16-bit half h = (i / 8) % 2 + 2 (j % 2) + 4 ((j / 8) % 2) of
// the four words (word h / 2, low half for even h) and is kept iff that half >= threshold = floor(p * 2^16) (at most
// 2^16 - 1): p is applied at 16-bit resolution. The eight elements are one A slice of a thread's forward S accumulator
// (rows: queries); in the backward's S^T (rows: keys) they belong to a thread and its neighbour four lanes away (keys j
// and j + 1), which compute one call each and exchange half of it. So either kernel draws a call per 8 elements.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "tk/ops/thread/philox.cuh"

namespace tk_attn {

struct Dropout {
  uint32_t seed_lo, seed_hi, offset, threshold;  // threshold: 16-bit
  float scale;  // 1 / (1 - p), rounded to fp32 on the host

  // The stream of a launch's arguments (attention.h): the low 32 bits of the offset, the threshold's high 16.
  static Dropout of(const DropoutArgs& a) {
    return {static_cast<uint32_t>(a.seed), static_cast<uint32_t>(a.seed >> 32), static_cast<uint32_t>(a.offset),
            a.threshold >> 16, a.scale};
  }

  __device__ __forceinline__ uint4 call(uint32_t bh, int i, int j) const {
    const uint32_t ig = uint32_t(i >> 4) * 8 + (i & 7), jg = uint32_t(j >> 4) * 4 + ((j & 7) >> 1);
    return tk::philox4x32<7>(make_uint4(jg, ig, bh, offset), seed_lo, seed_hi);
  }
  __device__ __forceinline__ uint32_t kept(uint32_t word, int half) const {
    return uint32_t(((half ? word >> 16 : word) & 0xFFFFu) >= threshold);
  }

  // Keep bits of A slice kk of this thread's 64 x N accumulator (acc_to_a's elements d[8 kk + e]), whose rows are
  // `row`, row + 8 (row % 16 < 8) and whose slice columns are col, col + 1 (chunk 2 kk) and col + 8, col + 9 (chunk
  // 2 kk + 1), col % 16 < 8 and even: bit e = x + 2 (row + 8) + 4 (col + 8) for column col + x.
  // Forward (rows: queries i, columns: keys j): the slice is one call's eight elements.
  __device__ __forceinline__ uint32_t keep8_queries(uint32_t bh, int row, int col) const {
    const uint4 w = call(bh, row, col);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    uint32_t bits = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int h = ((e >> 1) & 1) + 2 * (e & 1) + 4 * (e >> 2);  // i + 8: e bit 1; j + 1: e bit 0; j + 8: e bit 2
      bits |= kept(words[h >> 1], h & 1) << e;
    }
    return bits;
  }
  // Backward (rows: keys j, columns: queries i), warp-collective: this thread (keys row, row + 8) and the lane four
  // away (keys row ^ 1, row ^ 1 + 8, the same queries) need the calls of queries col (X) and col + 1 (Y); the even
  // key's thread draws X, the odd one's Y, and each passes the other the two words of its call it does not use.
  __device__ __forceinline__ uint32_t keep8_keys(uint32_t bh, int row, int col) const {
    const int jx = row & 1;
    const uint4 mine = call(bh, col + jx, row);
    // words of a call by key parity: (j + 8 clear, set) = (x, z) for even keys, (y, w) for odd ones
    const uint32_t keep_lo = jx ? mine.y : mine.x, keep_hi = jx ? mine.w : mine.z;
    const uint32_t give_lo = jx ? mine.x : mine.y, give_hi = jx ? mine.z : mine.w;
    const uint32_t got_lo = __shfl_xor_sync(0xffffffffu, give_lo, 4), got_hi = __shfl_xor_sync(0xffffffffu, give_hi, 4);
    // this thread's words of X and Y
    const uint32_t x_lo = jx ? got_lo : keep_lo, x_hi = jx ? got_hi : keep_hi;
    const uint32_t y_lo = jx ? keep_lo : got_lo, y_hi = jx ? keep_hi : got_hi;
    uint32_t bits = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {  // e bit 0: query + 1 (Y); bit 1: key + 8 (hi word); bit 2: query + 8 (high half)
      const uint32_t word = (e & 1) ? ((e & 2) ? y_hi : y_lo) : ((e & 2) ? x_hi : x_lo);
      bits |= kept(word, e >> 2) << e;
    }
    return bits;
  }

  // Keep bits of all BM / 16 slices of a 64 x BM accumulator whose slice kk starts at column col0 + 16 kk (bits
  // 8 kk + e). KEY_ROWS: the backward's S^T (keep8_keys), else the forward's S.
  template <bool KEY_ROWS, int BM>
  __device__ __forceinline__ uint64_t keep_tile(uint32_t bh, int row, int col0) const {
    static_assert(BM <= 128, "64 bits of keep flags");
    uint64_t bits = 0;
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const uint32_t b8 = KEY_ROWS ? keep8_keys(bh, row, col0 + 16 * kk) : keep8_queries(bh, row, col0 + 16 * kk);
      bits |= uint64_t(b8) << (8 * kk);
    }
    return bits;
  }
};

// acc_to_a of the kept elements (the others zero): `bits` are slice kk's keep8 flags.
template <typename T, int K>
__device__ __forceinline__ void acc_to_a_kept(uint32_t (&a)[4], const float (&d)[K], int kk, uint32_t bits) {
  const int c = 8 * kk;
  const auto kept = [&](int e) { return (bits >> e) & 1u ? d[c + e] : 0.f; };
  a[0] = pack2<T>(kept(0), kept(1));
  a[1] = pack2<T>(kept(2), kept(3));
  a[2] = pack2<T>(kept(4), kept(5));
  a[3] = pack2<T>(kept(6), kept(7));
}

}  // namespace tk_attn
