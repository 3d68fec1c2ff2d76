// Shared tiles and vectors.
//
// st<T, R, C> is stored as column blocks of `block_cols` columns (one swizzle span: 128, 64 or
// 32 bytes, the widest that divides a row); each block is R rows x block_cols, row-major, with
// the 16-byte chunks of each row XOR-swizzled by the row's position in its 8-row group. This is
// exactly the layout a TMA box of {block_cols, R} with CU_TENSOR_MAP_SWIZZLE_<bytes> writes and
// a wgmma descriptor with the same swizzle reads, and it keeps ldmatrix/stmatrix of 8 rows
// conflict-free. `Swizzle` may be forced (0 = none) for experiments such as the bank-conflict
// control; kernels should keep the default.
#pragma once
#include "../common.cuh"

namespace tk {

template <class T, int C> constexpr int widest_swizzle() {
    constexpr int row_bytes = C * int(sizeof(T));
    return row_bytes % 128 == 0 ? 128 : row_bytes % 64 == 0 ? 64 : row_bytes % 32 == 0 ? 32 : 0;
}

template <tile_scalar T_, int R, int C, int Swizzle = widest_swizzle<T_, C>()> struct alignas(1024) st {
    static_assert(R > 0 && C > 0 && R % BASE == 0 && C % BASE == 0, "shared tile sizes must be positive multiples of 16");
    static_assert(Swizzle == 0 || Swizzle == 32 || Swizzle == 64 || Swizzle == 128, "swizzle is 0, 32, 64 or 128 bytes");
    static_assert(Swizzle == 0 || (C * int(sizeof(T_))) % (Swizzle ? Swizzle : 1) == 0, "a swizzle span must divide the row width");
    using T = T_;
    static constexpr int rows = R, cols = C, height = R / BASE, width = C / BASE;
    static constexpr int swizzle_bytes = Swizzle;
    static constexpr int block_cols = Swizzle ? Swizzle / int(sizeof(T)) : C;  // columns per stored block
    static constexpr int bytes = R * C * int(sizeof(T));
    T data[R * C];

    // Byte offset of element (r, c) from the tile start (tile start is 1024-aligned).
    TK_HOST_DEVICE static uint32_t offset(int r, int c) {
        uint32_t o = uint32_t((c / block_cols) * R * block_cols + r * block_cols + c % block_cols) * sizeof(T);
        if constexpr (Swizzle) o ^= ((o % (Swizzle * 8)) >> 7) << 4;
        return o;
    }
    TK_DEVICE T& operator()(int r, int c) { return *reinterpret_cast<T*>(reinterpret_cast<char*>(data) + offset(r, c)); }
    TK_DEVICE const T& operator()(int r, int c) const {
        return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(data) + offset(r, c));
    }
};

template <class X> concept shared_tile = requires { X::swizzle_bytes; X::block_cols; X::rows; X::cols; };

template <tile_scalar T_, int N> struct alignas(16) sv {
    static_assert(N > 0 && N % BASE == 0, "shared vector length must be a positive multiple of 16");
    using T = T_;
    static constexpr int length = N, bytes = N * int(sizeof(T));
    T data[N];
    TK_DEVICE T& operator[](int i) { return data[i]; }
    TK_DEVICE const T& operator[](int i) const { return data[i]; }
};

template <class X> concept shared_vector = requires { X::length; X::bytes; sizeof(X::data); } && !shared_tile<X>;

}  // namespace tk
