// Warp-scope moves between shared and register memory. (row0, col0) place a smaller register
// tile inside a larger shared tile (multiples of 16). Same-type 16-bit tiles use ldmatrix /
// stmatrix (.trans for col layout): 16-byte rows of 8 different rows, which the swizzle puts in
// 8 different bank groups; other combinations convert element by element.
#pragma once
#include "matrix.cuh"
#include "../../types/rv.cuh"
#include "../../types/st.cuh"

namespace tk {

namespace detail {
// Address of the 8-element row segment this lane hands to ldmatrix/stmatrix x4 for base tile (r0, c0).
template <class RT, class ST> TK_DEVICE uint32_t ldsm_addr(const ST& s, int r0, int c0) {
    const int lane = laneid(), rr = lane & 7;
    // x4 matrix order = register order: row layout (0,0) (8,0) (0,8) (8,8); col layout (0,0) (0,8) (8,0) (8,8).
    const int r = r0 + rr + (RT::is_row ? x4_mrow(lane) : x4_mcol(lane));
    const int c = c0 + (RT::is_row ? x4_mcol(lane) : x4_mrow(lane));
    return smem_addr(s.data) + ST::offset(r, c);
}
template <class RT, class ST> constexpr bool use_ldsm =
    std::is_same_v<typename RT::T, typename ST::T> && sizeof(typename RT::T) == 2;
}  // namespace detail

template <register_tile RT, shared_tile ST> TK_DEVICE void load(RT& dst, const ST& src, int row0 = 0, int col0 = 0) {
    static_assert(RT::rows <= ST::rows && RT::cols <= ST::cols, "register tile larger than shared tile");
#pragma unroll
    for (int i = 0; i < RT::height; ++i)
#pragma unroll
        for (int w = 0; w < RT::width; ++w) {
            const int r0 = row0 + 16 * i, c0 = col0 + 16 * w;
            auto& t = dst.tiles[i][w];
            if constexpr (detail::use_ldsm<RT, ST>) {
                ldmatrix_x4<!RT::is_row>(*reinterpret_cast<uint32_t(*)[4]>(t.data), detail::ldsm_addr<RT>(src, r0, c0));
            } else {
                using L = typename RT::layout;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    t.data[k].x = convert<typename RT::T>(src(r0 + base_row<L>(k, 0), c0 + base_col<L>(k, 0)));
                    t.data[k].y = convert<typename RT::T>(src(r0 + base_row<L>(k, 1), c0 + base_col<L>(k, 1)));
                }
            }
        }
}

template <shared_tile ST, register_tile RT> TK_DEVICE void store(ST& dst, const RT& src, int row0 = 0, int col0 = 0) {
    static_assert(RT::rows <= ST::rows && RT::cols <= ST::cols, "register tile larger than shared tile");
#pragma unroll
    for (int i = 0; i < RT::height; ++i)
#pragma unroll
        for (int w = 0; w < RT::width; ++w) {
            const int r0 = row0 + 16 * i, c0 = col0 + 16 * w;
            const auto& t = src.tiles[i][w];
            if constexpr (detail::use_ldsm<RT, ST>) {
                const uint32_t* d = reinterpret_cast<const uint32_t*>(t.data);
                stmatrix_x4<!RT::is_row>(detail::ldsm_addr<RT>(dst, r0, c0), d[0], d[1], d[2], d[3]);
            } else {
                using L = typename RT::layout;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    dst(r0 + base_row<L>(k, 0), c0 + base_col<L>(k, 0)) = convert<typename ST::T>(t.data[k].x);
                    dst(r0 + base_row<L>(k, 1), c0 + base_col<L>(k, 1)) = convert<typename ST::T>(t.data[k].y);
                }
            }
        }
}

// Vectors: every lane reads the slots it holds; on store, one lane per replica group writes.
template <register_vector RV, shared_vector SV> TK_DEVICE void load(RV& dst, const SV& src, int off = 0) {
    static_assert(RV::length <= SV::length, "register vector longer than shared vector");
#pragma unroll
    for (int t = 0; t < RV::tiles; ++t)
#pragma unroll
        for (int s = 0; s < RV::per_base; ++s)
            dst.data[t][s] = convert<typename RV::T>(src[off + 16 * t + vec_pos<typename RV::layout>(s)]);
}
template <shared_vector SV, register_vector RV> TK_DEVICE void store(SV& dst, const RV& src, int off = 0) {
    static_assert(RV::length <= SV::length, "register vector longer than shared vector");
    const int lane = laneid();
    const bool writer = std::is_same_v<typename RV::layout, vec_pair8> ? (lane & 3) == 0 : (lane >> 2) == 0;
    if (!writer) return;
#pragma unroll
    for (int t = 0; t < RV::tiles; ++t)
#pragma unroll
        for (int s = 0; s < RV::per_base; ++s)
            dst[off + 16 * t + vec_pos<typename RV::layout>(s)] = convert<typename SV::T>(src.data[t][s]);
}

}  // namespace tk
