// Warp-scope matrix multiply on mma.sync.m16n8k16 (fp32 accumulate), destination first: d = a·b + c.
// Register tiles already hold the mma fragment layout (types/rt.cuh), so each 16x16x16 step is two
// mma.sync calls (n 0-7 and 8-15) on the base tiles' registers, with no data movement. For kernels whose
// GEMMs are too small or too irregular for a warpgroup's wgmma (per-warp chunk products, states that
// live in a warp's registers).
#pragma once
#include "../../types/rt.cuh"

namespace tk {

namespace detail {
// One m16n8k16: d = a·b + c on a base tile's fp32 pair registers (c and d may alias).
template <mma_scalar T> TK_DEVICE void mma16816(float2& d0, float2& d1, const packed_t<T> (&a)[4], packed_t<T> b0,
                                                packed_t<T> b1, const float2& c0, const float2& c1) {
    const uint32_t* A = reinterpret_cast<const uint32_t*>(a);
    const uint32_t B0 = *reinterpret_cast<const uint32_t*>(&b0), B1 = *reinterpret_cast<const uint32_t*>(&b1);
    if constexpr (std::is_same_v<T, bf16>)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%10, %11, %12, %13};"
                     : "=f"(d0.x), "=f"(d0.y), "=f"(d1.x), "=f"(d1.y)
                     : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B0), "r"(B1),
                       "f"(c0.x), "f"(c0.y), "f"(c1.x), "f"(c1.y));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%10, %11, %12, %13};"
                     : "=f"(d0.x), "=f"(d0.y), "=f"(d1.x), "=f"(d1.y)
                     : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B0), "r"(B1),
                       "f"(c0.x), "f"(c0.y), "f"(c1.x), "f"(c1.y));
}
}  // namespace detail

namespace detail {
// d = a·B + c over base tiles, where bt(k, j) gives B's base tile (k-th along K, j-th along N). In both B forms a
// base tile's registers 0/2 are the n 0-7 block's k halves and 1/3 the n 8-15 block's (rt.cuh), which is the
// mma's B fragment order.
template <int M, int N, int K, mma_scalar T, class BT>
TK_DEVICE void mma_tiles(rt_fl<M, N>& d, const rt<T, M, K, row_layout>& a, const rt_fl<M, N>& c, BT&& bt) {
#pragma unroll
    for (int i = 0; i < M / BASE; ++i)
#pragma unroll
        for (int j = 0; j < N / BASE; ++j) {
            const auto& ct = c.tiles[i][j].data;
            float2 acc[4] = {ct[0], ct[1], ct[2], ct[3]};
#pragma unroll
            for (int k = 0; k < K / BASE; ++k) {
                const auto& b = bt(k, j).data;
                mma16816<T>(acc[0], acc[1], a.tiles[i][k].data, b[0], b[2], acc[0], acc[1]);
                mma16816<T>(acc[2], acc[3], a.tiles[i][k].data, b[1], b[3], acc[2], acc[3]);
            }
            auto& dt = d.tiles[i][j].data;
            dt[0] = acc[0], dt[1] = acc[1], dt[2] = acc[2], dt[3] = acc[3];
        }
}
}  // namespace detail

// d (M x N) = a (M x K) · b (K x N) + c, with b in col layout (as ldmatrix.trans loads a K x N row-major shared tile).
template <int M, int N, int K, mma_scalar T>
TK_DEVICE void mma_AB(rt_fl<M, N>& d, const rt<T, M, K, row_layout>& a, const rt<T, K, N, col_layout>& b,
                      const rt_fl<M, N>& c) {
    detail::mma_tiles(d, a, c, [&](int k, int j) -> const auto& { return b.tiles[k][j]; });
}

// d (M x N) = a (M x K) · bᵀ + c with b (N x K) in row layout: its rows are the output's columns.
template <int M, int N, int K, mma_scalar T>
TK_DEVICE void mma_ABt(rt_fl<M, N>& d, const rt<T, M, K, row_layout>& a, const rt<T, N, K, row_layout>& b,
                       const rt_fl<M, N>& c) {
    detail::mma_tiles(d, a, c, [&](int k, int j) -> const auto& { return b.tiles[j][k]; });
}

}  // namespace tk
