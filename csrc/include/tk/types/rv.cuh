// Register vectors: one value per row (or column) of a register tile, spread over the warp
// exactly like that tile's rows (or columns), so broadcasts and reductions need no shuffles
// beyond the reduction itself.
//   vec_pair8: per 16 positions a lane holds 2 values, at lane/4 and lane/4 + 8
//   vec_quad:  per 16 positions a lane holds 4 values, at 2*(lane%4) + {0,1} and + 8
// A row-layout tile's rows follow vec_pair8 and its columns vec_quad; a col-layout tile the reverse.
#pragma once
#include "rt.cuh"

namespace tk {

struct vec_pair8 { static constexpr int per_base = 2; };
struct vec_quad { static constexpr int per_base = 4; };

template <tile_scalar T_, int N, class VL> struct rv {
    static_assert(N > 0 && N % BASE == 0, "register vector length must be a positive multiple of 16");
    using T = T_;
    using layout = VL;
    static constexpr int length = N, tiles = N / BASE, per_base = VL::per_base;
    T data[tiles][per_base];
};

template <class X> concept register_vector = requires { X::length; X::per_base; sizeof(X::data); };

// Vector with one value per row / per column of register tile RT (element type U, default the tile's).
template <register_tile RT, class U = typename RT::T>
using row_vec = rv<U, RT::rows, std::conditional_t<RT::is_row, vec_pair8, vec_quad>>;
template <register_tile RT, class U = typename RT::T>
using col_vec = rv<U, RT::cols, std::conditional_t<RT::is_row, vec_quad, vec_pair8>>;

// Position (within its 16-span) of vector slot i.
template <class VL> TK_DEVICE int vec_pos(int i) {
    if constexpr (std::is_same_v<VL, vec_pair8>) return pair8_pos(i);
    else return quad_pos(i);
}

}  // namespace tk
