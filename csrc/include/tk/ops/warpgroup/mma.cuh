// Warpgroup-scope matrix multiply on wgmma. The warpgroup computes a 64 x N block: each warp
// holds 16 rows of the fp32 accumulator as rt<float, 16, N>. A is a 64 x K shared tile (or, for
// mma_AB / mma_ABt, each warp's 16 x K register tile); B is always a shared tile.
//   mma_AB:   D += A   B     A: st<T,64,K> | rt<T,16,K>   B: st<T,K,N>
//   mma_ABt:  D += A   Bᵀ    A: st<T,64,K> | rt<T,16,K>   B: st<T,N,K>
//   mma_AtB:  D += Aᵀ  B     A: st<T,K,64>                B: st<T,K,N>
//   mma_AtBt: D += Aᵀ  Bᵀ    A: st<T,K,64>                B: st<T,N,K>
// With accumulate = 0 the old D is ignored (D = product). Each call fences, issues K/16 wgmmas
// and commits them as one group; call mma_async_wait<n>(...) before reading D or reusing inputs.
#pragma once
#include "descriptor.cuh"
#include "wgmma_ptx.cuh"
#include "../../types/st.cuh"

namespace tk {

namespace warpgroup {
// Order the warpgroup's register and shared-memory accesses before the next wgmmas; close a group of issued wgmmas.
TK_DEVICE void mma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
TK_DEVICE void mma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
}  // namespace warpgroup

namespace detail::wgmma {
using desc::encode;
using desc::add;
// Byte offset of the chunk-th 16-deep K slice of tile type ST from its start (K-major: K along the columns;
// MN-major: along the rows).
template <int MNMajor, shared_tile ST> TK_DEVICE constexpr uint32_t chunk_offset(int chunk) {
    constexpr int sw = ST::swizzle_bytes;
    return MNMajor ? desc::mnmajor_offset<sw>(chunk) : desc::kmajor_offset<sw>(chunk, ST::rows);
}
// Descriptor of tile t's first K slice; a slice's is that plus its chunk_offset (desc::add).
template <int MNMajor, shared_tile ST> TK_DEVICE uint64_t descriptor(const ST& t) {
    constexpr int sw = ST::swizzle_bytes;
    static_assert(sw != 0, "wgmma operands must be swizzled shared tiles");
    constexpr uint64_t mode = sw == 128 ? 1 : sw == 64 ? 2 : 3;
    constexpr uint64_t lbo = MNMajor ? uint64_t(ST::rows) * sw : 16;  // next column block along M/N; unused K-major
    return encode(smem_addr(t.data)) | encode(lbo) << 16 | encode(8 * sw) << 32 | mode << 62;
}
// Keeps the compiler from moving reads or writes of d across an asynchronous wgmma: an accumulator (rt<float, 16, N>
// or its registers as a float array) or an A operand (rt<bf16 or half, 16, K>, or fragments as uint32_t[KK][4]),
// which a wgmma in flight still reads.
template <class D> TK_DEVICE void fence_operand(D& d) {
    if constexpr (std::is_array_v<D> && std::is_array_v<std::remove_extent_t<D>>) {
#pragma unroll
        for (int kk = 0; kk < int(std::extent_v<D>); ++kk)
#pragma unroll
            for (int e = 0; e < int(std::extent_v<D, 1>); ++e) asm volatile("" : "+r"(d[kk][e])::"memory");
    } else if constexpr (std::is_array_v<D>) {
#pragma unroll
        for (int i = 0; i < int(std::extent_v<D>); ++i) asm volatile("" : "+f"(d[i])::"memory");
    } else if constexpr (std::is_same_v<typename D::T, float>) {
#pragma unroll
        for (int w = 0; w < D::width; ++w)
#pragma unroll
            for (int k = 0; k < 4; ++k)
                asm volatile("" : "+f"(d.tiles[0][w].data[k].x), "+f"(d.tiles[0][w].data[k].y)::"memory");
    } else {  // a 16-bit register A operand: each packed pair is one 32-bit register
#pragma unroll
        for (int w = 0; w < D::width; ++w)
#pragma unroll
            for (int k = 0; k < 4; ++k)
                asm volatile("" : "+r"(*reinterpret_cast<uint32_t*>(&d.tiles[0][w].data[k]))::"memory");
    }
}
template <class D> constexpr bool is_acc = std::is_same_v<typename D::T, float> && D::rows == 16 && D::is_row;

// A from shared (TA/TB: 1 = that operand is MN-major) or registers.
template <int TA, int TB, register_tile D, class A, shared_tile B> TK_DEVICE void mma(D& d, const A& a, const B& b, int accumulate) {
    static_assert(is_acc<D>, "wgmma accumulator must be rt<float, 16, N> (row layout) per warp");
    using T = typename B::T;
    static_assert(mma_scalar<T> && std::is_same_v<T, typename A::T>, "wgmma inputs are bf16 or fp16, both the same");
    constexpr int N = D::cols, K = TB ? B::rows : B::cols;
    static_assert((TB ? B::cols : B::rows) == N, "B's N dimension does not match D");
    fence_operand(d);
    warpgroup::mma_fence();
    if constexpr (register_tile<A>) {
        static_assert(TA == 0 && A::rows == 16 && A::cols == K && A::is_row, "register A must be rt<T, 16, K> row layout");
        const uint64_t db = descriptor<TB>(b);
#pragma unroll
        for (int c = 0; c < K / 16; ++c)
            ptx<T, N>::template rs<TB>(d, reinterpret_cast<const uint32_t*>(a.tiles[0][c].data),
                                        add(db, chunk_offset<TB, B>(c)), c == 0 ? accumulate : 1);
    } else {
        static_assert((TA ? A::cols : A::rows) == 64 && (TA ? A::rows : A::cols) == K, "shared A must be 64 x K (or K x 64)");
        const uint64_t da = descriptor<TA>(a), db = descriptor<TB>(b);
#pragma unroll
        for (int c = 0; c < K / 16; ++c)
            ptx<T, N>::template ss<TA, TB>(d, add(da, chunk_offset<TA, A>(c)), add(db, chunk_offset<TB, B>(c)),
                                           c == 0 ? accumulate : 1);
    }
    warpgroup::mma_commit();
    fence_operand(d);
}
}  // namespace detail::wgmma

namespace warpgroup {
template <register_tile D, class A, shared_tile B> TK_DEVICE void mma_AB(D& d, const A& a, const B& b, int accumulate = 1) {
    detail::wgmma::mma<0, 1>(d, a, b, accumulate);
}
template <register_tile D, class A, shared_tile B> TK_DEVICE void mma_ABt(D& d, const A& a, const B& b, int accumulate = 1) {
    detail::wgmma::mma<0, 0>(d, a, b, accumulate);
}
template <register_tile D, shared_tile A, shared_tile B> TK_DEVICE void mma_AtB(D& d, const A& a, const B& b, int accumulate = 1) {
    detail::wgmma::mma<1, 1>(d, a, b, accumulate);
}
template <register_tile D, shared_tile A, shared_tile B> TK_DEVICE void mma_AtBt(D& d, const A& a, const B& b, int accumulate = 1) {
    detail::wgmma::mma<1, 0>(d, a, b, accumulate);
}
// Overwriting forms: D = product.
template <register_tile D, class A, shared_tile B> TK_DEVICE void mm_AB(D& d, const A& a, const B& b) { mma_AB(d, a, b, 0); }
template <register_tile D, class A, shared_tile B> TK_DEVICE void mm_ABt(D& d, const A& a, const B& b) { mma_ABt(d, a, b, 0); }
template <register_tile D, shared_tile A, shared_tile B> TK_DEVICE void mm_AtB(D& d, const A& a, const B& b) { mma_AtB(d, a, b, 0); }
template <register_tile D, shared_tile A, shared_tile B> TK_DEVICE void mm_AtBt(D& d, const A& a, const B& b) { mma_AtBt(d, a, b, 0); }

// Wait until at most N committed wgmma groups are in flight; pass the accumulators about to be
// read so the compiler cannot move their uses above the wait.
template <int N = 0, class... Ds> TK_DEVICE void mma_async_wait(Ds&... ds) {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
    (detail::wgmma::fence_operand(ds), ...);
}

// The raw forms, for kernels that lay their operands out themselves (the attention kernels' 64-wide panels, with
// tk::desc descriptors): one wgmma m64nNk16 into a warp's N/2 accumulator registers, A from shared memory (mma_ss,
// TA/TB: 1 = that operand is MN-major) or from four packed registers (mma_rs). The caller fences, commits and waits
// around a group of them (mma_fence, mma_commit, mma_async_wait) and holds its registers with hold().
template <mma_scalar T, int TA, int TB, int K> TK_DEVICE void mma_ss(float (&d)[K], uint64_t a, uint64_t b, int scale_d) {
    detail::wgmma::ptx<T, 2 * K>::template ss<TA, TB>(d, a, b, scale_d);
}
template <mma_scalar T, int TB, int K> TK_DEVICE void mma_rs(float (&d)[K], const uint32_t (&a)[4], uint64_t b, int scale_d) {
    detail::wgmma::ptx<T, 2 * K>::template rs<TB>(d, a, b, scale_d);
}
// Registers an asynchronous wgmma reads or writes, pinned in place until here (detail::wgmma::fence_operand).
template <class D> TK_DEVICE void hold(D& d) { detail::wgmma::fence_operand(d); }
}  // namespace warpgroup

}  // namespace tk
