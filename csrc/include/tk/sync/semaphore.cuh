// mbarrier semaphores: a phase completes when `count` arrivals and all expected TMA bytes have
// landed; waiters name the phase parity they wait for (0, 1, 0, ...).
#pragma once
#include "../common.cuh"

namespace tk {

struct semaphore {
    uint64_t value;
};

TK_DEVICE void init_semaphore(semaphore& s, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&s)), "r"(count) : "memory");
}
// After the initialisations, before any other thread or the async proxy uses the semaphores (then a barrier).
TK_DEVICE void fence_semaphore_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
TK_DEVICE void invalidate_semaphore(semaphore& s) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(&s)) : "memory");
}
// One arrival (release: the caller's earlier shared-memory accesses are ordered before it).
TK_DEVICE void arrive(semaphore& s) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(&s)) : "memory");
}
TK_DEVICE void arrive(semaphore& s, int count) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&s)), "r"(count) : "memory");
}
namespace warp {
// One arrival for the calling warp, by its lane 0; predicated rather than branched: no branch may sit between a
// wgmma and its wait (ptxas would serialise the wgmmas).
TK_DEVICE void arrive(semaphore& s) {
    asm volatile("{ .reg .pred p; setp.eq.u32 p, %1, 0; @p mbarrier.arrive.release.cta.shared::cta.b64 _, [%0]; }"
                 ::"r"(smem_addr(&s)), "r"(laneid()) : "memory");
}
}  // namespace warp
// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
TK_DEVICE void expect_bytes(semaphore& s, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&s)), "r"(bytes) : "memory");
}
// Announce bytes without arriving.
TK_DEVICE void expect_bytes_only(semaphore& s, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&s)), "r"(bytes) : "memory");
}
// True once the phase with this parity has completed (non-blocking).
TK_DEVICE bool test_wait(semaphore& s, int parity) {
    uint32_t done;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(&s)), "r"(parity)
        : "memory");
    return done;
}
// Block until the phase with this parity has completed (acquire). The spin is one PTX loop around try_wait (which
// itself suspends the thread for a while), not a C++ loop over test_wait: ptxas keeps it as a tight branch back.
TK_DEVICE void wait(semaphore& s, int parity) {
    asm volatile("{ .reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=; }" ::"r"(smem_addr(&s)), "r"(parity) : "memory");
}

}  // namespace tk
