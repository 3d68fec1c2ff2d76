// Low-level Hopper primitives for the attention kernels: mbarriers, TMA tile
// loads, wgmma fences and shared-memory matrix descriptors, register-fragment
// helpers. Torch-free. These mirror what csrc/include/tk provides; the kernels
// keep their own copies so that they do not depend on the tile library's
// in-progress API (see README.md here).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "tk/common.cuh"
#include "tk/ops/warp/matrix.cuh"
#include "tk/ops/warpgroup/descriptor.cuh"
#include "wgmma.cuh"

namespace tk_attn {

// Task t of a grid over (head, block) pairs -> (head, rank of its block): heads are walked in sections of
// `section` heads, small enough that their operands stay in L2 while the grid works on them, and inside a
// section the ranks go outermost, so the blocks of one rank run across the section's heads together (the
// caller puts the heaviest blocks at rank 0). section = 1 walks head by head.
__device__ __forceinline__ void section_decode(int t, int heads_total, int ranks, int section, int& head,
                                               int& rank) {
  const int per_section = section * ranks;
  const int sec = t / per_section;
  const int r = t - sec * per_section;
  const int heads = min(section, heads_total - sec * section);
  rank = r / heads;
  head = sec * section + (r - rank * heads);
}

// Heads per section for section_decode (host side): enough that a section holds about `blocks` blocks of `ranks`
// each, at most `max_heads` (an L2 budget) and `heads_total`, at least 1.
inline int section_heads(int64_t heads_total, int ranks, int64_t blocks, int64_t max_heads) {
  const int64_t by_blocks = (blocks + ranks - 1) / ranks;
  const int64_t h = by_blocks < max_heads ? by_blocks : max_heads;
  return static_cast<int>(h < 1 ? 1 : (h < heads_total ? h : heads_total));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory accesses by 32-bit shared address. Plain C++ accesses through the kernels' smem pointers compiled to
// generic LD/ST (ptxas could not prove the address space), which queue on the global-memory (LG) path: ncu showed
// the backward stalled on lg_throttle there.
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
// stmatrix .x4 (tk/ops/warp/matrix.cuh): one instruction stores what sixteen st.shared.b32 would; the backward's
// consumers were stalled on the MIO queue behind their shared stores (ncu). This lane's address inside a block of
// 16 rows x 32 bytes in acc_to_a's register order (the matrices at rows 0/8 x bytes 0/16): its row and byte column,
// in bytes so that the fp32 dQ staging uses it too.
using tk::stmatrix_x4;
__device__ __forceinline__ int stsm_row(int lane) { return (lane & 7) + tk::x4_mrow(lane); }
__device__ __forceinline__ int stsm_byte(int lane) { return 16 * (lane >> 4); }

// Two adjacent floats from shared (SHARED) or global memory.
template <bool SHARED>
__device__ __forceinline__ float2 load_pair(const float* p) {
  if constexpr (SHARED) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(smem_u32(p)));
    return v;
  } else {
    return *reinterpret_cast<const float2*>(p);
  }
}
// Four adjacent floats (16-byte aligned) from shared (SHARED) or global memory.
template <bool SHARED>
__device__ __forceinline__ float4 load_quad(const float* p) {
  if constexpr (SHARED) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(smem_u32(p)));
    return v;
  } else {
    return *reinterpret_cast<const float4*>(p);
  }
}

// ---- mbarrier semaphores ---------------------------------------------------
__device__ __forceinline__ void bar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void bar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the phase with the given parity has completed. A fresh barrier
// is in phase 0, so waiting on parity 1 returns at once (used for "empty"
// barriers that start out free).
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA -----------------------------------------------------------------------
// 2-D tiled bulk copy global -> shared.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// 4-D tiled bulk copy global -> shared; rows outside the tensor read as zero.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// 4-D tiled bulk copy shared -> global (a bulk group: bulk_commit, then bulk_wait_*); elements outside the tensor
// are not written.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(map),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
// Predicated forms (no branch: code that runs while a wgmma is in flight must not branch, or ptxas serializes it).
__device__ __forceinline__ void tma_store_4d_if(bool pred, const CUtensorMap* map, const void* src, int c0, int c1,
                                                int c2, int c3) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "@p cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n}\n" ::"l"(map),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(int(pred))
      : "memory");
}
__device__ __forceinline__ void bulk_commit_if(bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p cp.async.bulk.commit_group;\n}\n" ::"r"(int(pred)) : "memory");
}
__device__ __forceinline__ void bulk_wait_read_if(bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p cp.async.bulk.wait_group.read 0;\n}\n" ::"r"(int(pred))
               : "memory");
}
__device__ __forceinline__ void st_global_if(bool pred, float* ptr, float v) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p st.global.f32 [%0], %1;\n}\n" ::"l"(ptr), "f"(v),
               "r"(int(pred))
               : "memory");
}
// 1/x and log2(x) by the MUFU alone (no range fix-up branches; x is a softmax row sum, >= 1).
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// Bulk tensor reduce-add shared -> global (fp32 add, done by the TMA unit).
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(map),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until the issuing thread's bulk groups have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// ---- wgmma -----------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an async wgmma.
template <int K>
__device__ __forceinline__ void fence_regs(float (&d)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A-operand fragments: keeps them live (and unchanged) until here, while an async wgmma reads them.
template <int KK>
__device__ __forceinline__ void fence_regs(uint32_t (&a)[KK][4]) {
#pragma unroll
  for (int kk = 0; kk < KK; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[kk][e])::"memory");
}

// Shared tiles are stored as column panels of 64 elements (128 bytes per row,
// the TMA box width for 128-byte swizzle), each panel [rows][64], 1024-byte
// aligned. Descriptor fields are in 16-byte units.
using tk::desc::encode;
// K-major operand (the contraction dim is the contiguous one): 8-row groups
// 1024 bytes apart; leading offset unused with 128-byte swizzle.
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t saddr) {
  return encode(saddr) | (encode(16) << 16) | (encode(1024) << 32) | (1ull << 62);
}
// MN-major operand (the output dim is contiguous): 64-wide panels `panel_bytes`
// apart, 8-row groups of the contraction dim 1024 bytes apart.
__device__ __forceinline__ uint64_t desc_mnmajor(uint32_t saddr, uint32_t panel_bytes) {
  return encode(saddr) | (encode(panel_bytes) << 16) | (encode(1024) << 32) | (1ull << 62);
}
// The descriptor of the k-th 16-deep slice from the operand's base descriptor d (one add, not a re-encoding):
// K-major panels of `rows` rows, or MN-major.
__device__ __forceinline__ uint64_t kmajor_step(uint64_t d, int k, int rows) {
  return tk::desc::add(d, tk::desc::kmajor_offset<128>(k, rows));
}
__device__ __forceinline__ uint64_t mnmajor_step(uint64_t d, int k) {
  return tk::desc::add(d, tk::desc::mnmajor_offset<128>(k));
}
template <typename T>
struct wgmma_op;
template <>
struct wgmma_op<__nv_bfloat16> {
  template <int TA, int TB, int K>
  __device__ static void ss(float (&d)[K], uint64_t a, uint64_t b, int scale_d) {
    wgmma_ss_bf16<TA, TB>(d, a, b, scale_d, Int<2 * K>{});
  }
  template <int TB, int K>
  __device__ static void rs(float (&d)[K], const uint32_t (&a)[4], uint64_t b, int scale_d) {
    wgmma_rs_bf16<TB>(d, a, b, scale_d, Int<2 * K>{});
  }
};
template <>
struct wgmma_op<__half> {
  template <int TA, int TB, int K>
  __device__ static void ss(float (&d)[K], uint64_t a, uint64_t b, int scale_d) {
    wgmma_ss_f16<TA, TB>(d, a, b, scale_d, Int<2 * K>{});
  }
  template <int TB, int K>
  __device__ static void rs(float (&d)[K], const uint32_t (&a)[4], uint64_t b, int scale_d) {
    wgmma_rs_f16<TB>(d, a, b, scale_d, Int<2 * K>{});
  }
};

// Two fp32 -> one packed 16-bit pair (low half = first element).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The wgmma accumulator of a 64 x N tile: thread (warp w, lane l) holds rows
// 16w + l/4 and +8; for each 8-column chunk c, d[4c+0..1] are row r0 columns
// 8c + 2(l%4) + {0,1} and d[4c+2..3] the same columns of row r0 + 8. A
// 64 x 16 A-operand slice kk is then chunks 2kk and 2kk+1 re-packed.
template <typename T, int K>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&d)[K], int kk) {
  const int c0 = 8 * kk, c1 = 8 * kk + 4;
  a[0] = pack2<T>(d[c0 + 0], d[c0 + 1]);
  a[1] = pack2<T>(d[c0 + 2], d[c0 + 3]);
  a[2] = pack2<T>(d[c1 + 0], d[c1 + 1]);
  a[3] = pack2<T>(d[c1 + 2], d[c1 + 3]);
}

// Byte offset of element (row, col) inside a [rows][64] 128-byte-swizzled panel
// (16-byte chunk index XOR row % 8), the layout TMA writes and wgmma reads.
__device__ __forceinline__ uint32_t swz128(int row, int col, int elem_bytes) {
  const uint32_t byte = col * elem_bytes;
  return row * 128 + ((((byte >> 4) ^ (row & 7)) << 4) | (byte & 15));
}

__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrive without waiting (the other side of a producer/consumer named barrier waits with named_bar_sync).
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Turns at the tensor cores for NC consumer warpgroups (the forward's ping-pong, the backward's TURNS): consumer c
// waits on named barrier FIRST + c, and passes the turn by arriving on the next consumer's (256 threads: the
// waiter and the one handing over). ON = false: no-ops.
// The last consumer passes once before the loop so that consumer 0 goes first, and consumer 0 takes that final
// hand-over after it.
template <bool ON, int FIRST, int NC>
struct Turns {
  static __device__ __forceinline__ void wait(int c) {
    if constexpr (ON) named_bar_sync(FIRST + c, 256);
  }
  static __device__ __forceinline__ void pass(int c) {
    if constexpr (ON) named_bar_arrive(FIRST + (c + 1) % NC, 256);
  }
  // One turn: wait, issue (the caller's wgmmas), pass.
  template <typename F>
  static __device__ __forceinline__ void take(int c, F&& issue) {
    wait(c);
    issue();
    pass(c);
  }
};

template <int R>
__device__ __forceinline__ void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

}  // namespace tk_attn
