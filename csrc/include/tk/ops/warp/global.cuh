// Warp-scope moves between global and register memory, bounds-checked: elements outside the
// view read as zero and are never written, so a tile may hang over any edge. `at` is in units of
// the register tile (rows RT::rows, cols RT::cols); the *_at forms take element offsets.
#pragma once
#include "../../types/gl.cuh"
#include "../../types/rv.cuh"

namespace tk {

template <register_tile RT, class GL> TK_DEVICE void load_at(RT& dst, const GL& g, int b, int h, int row0, int col0) {
    using L = typename RT::layout;
    const int R = g.rows(), C = g.cols();
    detail::for_each(dst, [&](int i, int w, int k, int j) {
        const int r = row0 + 16 * i + base_row<L>(k, j), c = col0 + 16 * w + base_col<L>(k, j);
        return (r < R && c < C) ? convert<float>(g.row_ptr(b, h, r)[c]) : 0.f;
    });
}

template <class GL, register_tile RT> TK_DEVICE void store_at(const GL& g, const RT& src, int b, int h, int row0, int col0) {
    using L = typename RT::layout;
    using T = typename GL::T;
    const int R = g.rows(), C = g.cols();
    // Row layout holds horizontal pairs: one packed store when the pair is in bounds and aligned.
    const bool pairs = RT::is_row && (g.row_stride() % 2 == 0) && (g.strides[0] % 2 == 0) && (g.strides[1] % 2 == 0) &&
                       (reinterpret_cast<uintptr_t>(g.raw) % (2 * sizeof(T)) == 0);
#pragma unroll
    for (int i = 0; i < RT::height; ++i)
#pragma unroll
        for (int w = 0; w < RT::width; ++w)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const auto& p = src.tiles[i][w].data[k];
                const int r = row0 + 16 * i + base_row<L>(k, 0), c = col0 + 16 * w + base_col<L>(k, 0);
                if constexpr (RT::is_row) {
                    if (r >= R) continue;
                    T* row = g.row_ptr(b, h, r);
                    if (pairs && c + 1 < C) {
                        *reinterpret_cast<packed_t<T>*>(row + c) = make_packed<T>(convert<T>(p.x), convert<T>(p.y));
                    } else {
                        if (c < C) row[c] = convert<T>(p.x);
                        if (c + 1 < C) row[c + 1] = convert<T>(p.y);
                    }
                } else {
                    if (c >= C) continue;
                    if (r < R) g.row_ptr(b, h, r)[c] = convert<T>(p.x);
                    if (r + 1 < R) g.row_ptr(b, h, r + 1)[c] = convert<T>(p.y);
                }
            }
}

template <register_tile RT, class GL> TK_DEVICE void load(RT& dst, const GL& g, coord at) {
    load_at(dst, g, at.b, at.h, at.r * RT::rows, at.c * RT::cols);
}
template <class GL, register_tile RT> TK_DEVICE void store(const GL& g, const RT& src, coord at) {
    store_at(g, src, at.b, at.h, at.r * RT::rows, at.c * RT::cols);
}

// Vectors lie along a row: elements [at.c * N, at.c * N + N) of row at.r of (at.b, at.h).
template <register_vector RV, class GL> TK_DEVICE void load(RV& dst, const GL& g, coord at) {
    const int C = g.cols();
    const auto* row = g.row_ptr(at.b, at.h, at.r);
#pragma unroll
    for (int t = 0; t < RV::tiles; ++t)
#pragma unroll
        for (int s = 0; s < RV::per_base; ++s) {
            const int c = at.c * RV::length + 16 * t + vec_pos<typename RV::layout>(s);
            dst.data[t][s] = convert<typename RV::T>(c < C ? convert<float>(row[c]) : 0.f);
        }
}
template <class GL, register_vector RV> TK_DEVICE void store(const GL& g, const RV& src, coord at) {
    const int lane = laneid(), C = g.cols();
    const bool writer = std::is_same_v<typename RV::layout, vec_pair8> ? (lane & 3) == 0 : (lane >> 2) == 0;
    if (!writer) return;
    auto* row = g.row_ptr(at.b, at.h, at.r);
#pragma unroll
    for (int t = 0; t < RV::tiles; ++t)
#pragma unroll
        for (int s = 0; s < RV::per_base; ++s) {
            const int c = at.c * RV::length + 16 * t + vec_pos<typename RV::layout>(s);
            if (c < C) row[c] = convert<typename GL::T>(src.data[t][s]);
        }
}

}  // namespace tk
