// Single-thread accesses by address space: shared memory by its 32-bit shared address, where a generic pointer would
// compile to generic LD/ST (ptxas cannot always prove the space, and generic accesses queue on the global-memory
// path: the attention backward stalled on lg_throttle there), and a predicated global store.
#pragma once
#include <cstdint>

#include "../../common.cuh"

namespace tk {

TK_DEVICE void st_shared(uint32_t addr, uint32_t v) { asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"); }
TK_DEVICE void st_shared(uint32_t addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
TK_DEVICE float ld_shared_f32(uint32_t addr) {
    float f;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(f) : "r"(addr) : "memory");
    return f;
}
TK_DEVICE float2 ld_shared_v2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}
TK_DEVICE float4 ld_shared_v4(uint32_t addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}
TK_DEVICE uint4 ld_shared_u4(uint32_t addr) {
    uint4 q;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w) : "r"(addr) : "memory");
    return q;
}
// *ptr = v if pred, predicated (no branch: it runs while a wgmma is in flight).
TK_DEVICE void st_global_if(bool pred, float* ptr, float v) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p st.global.f32 [%0], %1; }" ::"l"(ptr), "f"(v), "r"(int(pred)) : "memory");
}

}  // namespace tk
