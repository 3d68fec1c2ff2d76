// Base types, thread-position helpers and scalar conversions shared by every header.
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define TK_DEVICE __device__ __forceinline__
#define TK_HOST_DEVICE __host__ __device__ __forceinline__

namespace tk {

using bf16 = __nv_bfloat16;
using half = __half;
using bf16_2 = __nv_bfloat162;
using half_2 = __half2;

constexpr int WARP_THREADS = 32;
constexpr int WARPGROUP_WARPS = 4;
constexpr int WARPGROUP_THREADS = 128;
constexpr int BASE = 16;  // register and shared tiles are made of 16x16 base tiles

// The dynamic shared memory base rounded up to ALIGN bytes (TMA's 128-byte swizzle needs 1024). It advances the
// __shared__ array's own pointer rather than round-tripping through an integer, so the compiler can still tell the
// result is shared memory and emit LDS/STS: after a uintptr_t round trip, plain accesses through it compiled to
// generic LD/ST on the global-memory path (the attention forward's task slot). Where a pointer is merged with a
// global one, the compiler loses track anyway; the attention kernels use explicit st.shared/ld.shared there.
template <int ALIGN, class T> TK_DEVICE T* align_shared(T* raw) {
    static_assert(sizeof(T) == 1 && (ALIGN & (ALIGN - 1)) == 0, "a byte pointer and a power-of-two alignment");
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
    return raw + ((ALIGN - (addr & (ALIGN - 1))) & (ALIGN - 1));
}

TK_DEVICE int laneid() { return threadIdx.x & 31; }
// v as lane 0 has it: the compiler then treats it as warp-uniform and keeps what derives from it (a warpgroup's
// shared-memory bases, its wgmma descriptors) in uniform registers, where a threadIdx-derived value costs an R2UR
// per wgmma.
TK_DEVICE int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }
TK_DEVICE int warpid() { return threadIdx.x >> 5; }
TK_DEVICE int warpgroupid() { return threadIdx.x >> 7; }
TK_DEVICE int warpid_in_group() { return (threadIdx.x >> 5) & 3; }

// v summed (or its max) over the warp's 32 lanes, and summed over the quad of lanes that share an mma fragment's rows
// (lane / 4).
TK_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
TK_DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
TK_DEVICE float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The packed pair each register of a base tile holds: two adjacent elements.
template <class T> struct packed;
template <> struct packed<float> { using type = float2; };
template <> struct packed<bf16> { using type = bf16_2; };
template <> struct packed<half> { using type = half_2; };
template <class T> using packed_t = typename packed<T>::type;

template <class T>
concept tile_scalar = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, half>;
template <class T>
concept mma_scalar = std::is_same_v<T, bf16> || std::is_same_v<T, half>;

// Scalar conversion between the three element types (fp32 <-> bf16/fp16).
template <class To, class From> TK_HOST_DEVICE To convert(From x) {
    if constexpr (std::is_same_v<To, From>) return x;
    else if constexpr (std::is_same_v<From, float>) {
        if constexpr (std::is_same_v<To, bf16>) return __float2bfloat16_rn(x);
        else return __float2half_rn(x);
    } else if constexpr (std::is_same_v<To, float>) {
        if constexpr (std::is_same_v<From, bf16>) return __bfloat162float(x);
        else return __half2float(x);
    } else {
        return convert<To>(convert<float>(x));  // bf16 <-> fp16 goes through fp32
    }
}

template <class T> TK_DEVICE T first(packed_t<T> p) { return p.x; }
template <class T> TK_DEVICE T second(packed_t<T> p) { return p.y; }
template <class T> TK_DEVICE packed_t<T> make_packed(T a, T b) {
    packed_t<T> p;
    p.x = a;
    p.y = b;
    return p;
}

template <class T> TK_DEVICE uint32_t as_u32(const T& x) {
    static_assert(sizeof(T) == 4);
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    return u;
}

TK_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// An empty asm that makes the compiler treat w (a 16- or 32-bit word) as redefined here: work on it is not hoisted
// above this point (e.g. a loop-invariant unpacking, which would hold 4x the registers across the loop).
template <class W> TK_DEVICE void pin(W& w) {
    static_assert(sizeof(W) == 4 || sizeof(W) == 2, "a 16- or 32-bit word");
    if constexpr (sizeof(W) == 4) asm volatile("" : "+r"(w));
    else asm volatile("" : "+h"(w));
}

// Named barrier among `threads` threads (bar 0 is __syncthreads).
TK_DEVICE void named_sync(int id, int threads) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory"); }

// Arrive at named barrier `id` without waiting (the other side of a producer/consumer pair waits with named_sync).
TK_DEVICE void named_arrive(int id, int threads) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory"); }

namespace warpgroup {
// Synchronise the 128 threads of the calling warpgroup on named barrier `id` (1..15; callers pick distinct ids).
TK_DEVICE void sync(int id) { named_sync(id, WARPGROUP_THREADS); }
}  // namespace warpgroup

// Make ordinary shared-memory writes visible to the async proxy (TMA, wgmma) before a barrier.
TK_DEVICE void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace tk
