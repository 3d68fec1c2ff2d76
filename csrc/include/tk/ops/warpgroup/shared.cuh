// Warpgroup-scope moves: the warpgroup's 4 warps split a tile by rows, warp w taking rows
// [w * RT::rows, (w + 1) * RT::rows) (the same split as the wgmma accumulator).
#pragma once
#include "../warp/shared.cuh"
#include "../warp/global.cuh"

namespace tk::warpgroup {

template <register_tile RT, shared_tile ST> TK_DEVICE void load(RT& dst, const ST& src, int col0 = 0) {
    static_assert(RT::rows * WARPGROUP_WARPS == ST::rows, "each warp takes a quarter of the shared tile's rows");
    ::tk::load(dst, src, warpid_in_group() * RT::rows, col0);
}
template <shared_tile ST, register_tile RT> TK_DEVICE void store(ST& dst, const RT& src, int col0 = 0) {
    static_assert(RT::rows * WARPGROUP_WARPS == ST::rows, "each warp takes a quarter of the shared tile's rows");
    ::tk::store(dst, src, warpid_in_group() * RT::rows, col0);
}
// Global moves of the warpgroup's (4 * RT::rows) x RT::cols block at tile coordinate `at`, bounds-checked.
template <register_tile RT, class GL> TK_DEVICE void load(RT& dst, const GL& g, coord at) {
    ::tk::load_at(dst, g, at.b, at.h, (at.r * WARPGROUP_WARPS + warpid_in_group()) * RT::rows, at.c * RT::cols);
}
template <class GL, register_tile RT> TK_DEVICE void store(const GL& g, const RT& src, coord at) {
    ::tk::store_at(g, src, at.b, at.h, (at.r * WARPGROUP_WARPS + warpid_in_group()) * RT::rows, at.c * RT::cols);
}

// t = f(t) element by element, in place: the warpgroup's threads take the tile's 16-byte pieces in turn (an elementwise
// map needs no layout). The caller fences (fence_async_shared) and syncs before wgmma or other threads read the result.
template <shared_tile ST, class F> TK_DEVICE void map(ST& t, F&& f) {
    using T = typename ST::T;
    constexpr int per = 16 / int(sizeof(T)), pieces = ST::rows * ST::cols / per;
    uint4* p = reinterpret_cast<uint4*>(t.data);
#pragma unroll 4
    for (int i = threadIdx.x % WARPGROUP_THREADS; i < pieces; i += WARPGROUP_THREADS) {
        uint4 piece = p[i];
        T* e = reinterpret_cast<T*>(&piece);
#pragma unroll
        for (int j = 0; j < per; ++j) e[j] = convert<T>(f(convert<float>(e[j])));
        p[i] = piece;
    }
}

}  // namespace tk::warpgroup
