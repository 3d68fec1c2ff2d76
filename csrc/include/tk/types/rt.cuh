// Register tiles: R x C matrices held by one warp as a grid of 16x16 base tiles.
//
// Each base tile is 4 registers of packed pairs, in the mma.m16n8k16 / wgmma fragment layout:
//   row layout: data[k] holds elements (r, c), (r, c+1) with
//               r = lane/4 + 8*(k%2),  c = 2*(lane%4) + 8*(k/2)
//   col layout: the row layout of the transpose, i.e. data[k] holds (r, c), (r+1, c) with
//               r = 2*(lane%4) + 8*(k/2),  c = lane/4 + 8*(k%2)
// So in both layouts "k%2" picks the lane/4 position and "(k/2)*2 + j" (j = pair half) the
// 2*(lane%4) position; only which axis is which differs. Every op below relies on that.
#pragma once
#include "../common.cuh"

namespace tk {

struct row_layout {};
struct col_layout {};
template <class L> concept tile_layout = std::is_same_v<L, row_layout> || std::is_same_v<L, col_layout>;

template <class T, class L> struct rt_base {
    using dtype = packed_t<T>;
    dtype data[4];
};

template <tile_scalar T_, int R, int C, tile_layout L = row_layout> struct rt {
    static_assert(R > 0 && C > 0 && R % BASE == 0 && C % BASE == 0, "register tile sizes must be positive multiples of 16");
    using T = T_;
    using layout = L;
    static constexpr int rows = R, cols = C, height = R / BASE, width = C / BASE;
    static constexpr bool is_row = std::is_same_v<L, row_layout>;
    rt_base<T, L> tiles[height][width];
};

template <class X> concept register_tile = requires { typename X::layout; X::height; X::width; sizeof(X::tiles); };

template <int R, int C, class L = row_layout> using rt_fl = rt<float, R, C, L>;
template <int R, int C, class L = row_layout> using rt_bf = rt<bf16, R, C, L>;
template <int R, int C, class L = row_layout> using rt_hf = rt<half, R, C, L>;

// A col-layout tile's registers are those of its transpose in row layout (above): the same object seen as that
// row tile, at no cost. For tiles one base tile wide or high, whose grids [h][1] and [1][h] are laid out alike.
template <tile_scalar T, int R, int C> TK_DEVICE const rt<T, C, R, row_layout>& transposed(const rt<T, R, C, col_layout>& t) {
    static_assert(R == BASE || C == BASE, "transposed: one side must be a single base tile");
    return reinterpret_cast<const rt<T, C, R, row_layout>&>(t);
}

// Position (within a 16-wide base span) of the lane/4 axis ("pair8") and 2*(lane%4) axis ("quad").
TK_DEVICE int pair8_pos(int h) { return (laneid() >> 2) + 8 * h; }              // h = k%2
TK_DEVICE int quad_pos(int q) { return 2 * (laneid() & 3) + (q & 1) + 8 * (q >> 1); }  // q = (k/2)*2 + j

// Row and column (within the base tile) of register k, pair half j, for layout L.
template <class L> TK_DEVICE int base_row(int k, int j) {
    if constexpr (std::is_same_v<L, row_layout>) return pair8_pos(k & 1);
    else return quad_pos((k >> 1) * 2 + j);
}
template <class L> TK_DEVICE int base_col(int k, int j) {
    if constexpr (std::is_same_v<L, row_layout>) return quad_pos((k >> 1) * 2 + j);
    else return pair8_pos(k & 1);
}

namespace detail {
// dst(element) = g(tile row i, tile col w, register k, pair half j) for every element of a register tile
// (g returns float; the result is rounded to the tile type). The one traversal every tile op builds on.
template <register_tile D, class G> TK_DEVICE void for_each(D& dst, G&& g) {
    using T = typename D::T;
#pragma unroll
    for (int i = 0; i < D::height; ++i)
#pragma unroll
        for (int w = 0; w < D::width; ++w)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                auto& p = dst.tiles[i][w].data[k];
                p.x = convert<T>(g(i, w, k, 0));
                p.y = convert<T>(g(i, w, k, 1));
            }
}
}  // namespace detail

}  // namespace tk
