// ldmatrix / stmatrix .x4: four 8 x 8 matrices of 16-byte rows between shared memory and four 32-bit registers
// per lane. Register i is matrix i (lane l holds bytes 4 (l % 4) .. +3 of its row l / 4); lane l hands the address
// of row l % 8 of matrix l / 8. With matrix m placed at (x4_mrow(m), x4_mcol(m)) of a 16 x 16 block of 16-bit
// elements -- (0, 0), (8, 0), (0, 8), (8, 8) -- the registers are an mma A fragment (a row-layout rt base tile).
#pragma once
#include "../../common.cuh"

namespace tk {

// The block offsets of the matrix whose row address lane l hands over (l / 8), in the A-fragment order.
TK_DEVICE int x4_mrow(int lane) { return 8 * ((lane >> 3) & 1); }
TK_DEVICE int x4_mcol(int lane) { return 8 * (lane >> 4); }

template <bool TRANS = false> TK_DEVICE void ldmatrix_x4(uint32_t (&d)[4], uint32_t addr) {
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
}

template <bool TRANS = false>
TK_DEVICE void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    if constexpr (TRANS)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                     ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
    else
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                     ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

}  // namespace tk
