// LCSF: load / compute / store / finish. A kernel is a struct K; this template owns the rest:
// one producer warpgroup and K::CONSUMER_WARPGROUPS consumer warpgroups, a ring of
// K::INPUT_PIPE_STAGES input blocks in shared memory with full/empty mbarriers, register
// re-allocation (producer down to PRODUCER_REGS, consumers up to CONSUMER_REGS) and the
// persistent task loop (task = blockIdx.x, += gridDim.x).
//
// K provides
//   static constexpr int CONSUMER_WARPGROUPS, INPUT_PIPE_STAGES, PRODUCER_REGS, CONSUMER_REGS;
//   struct globals;        kernel arguments (views, tma_maps, sizes): passed as __grid_constant__
//   struct input_block;    one ring stage (shared tiles)
//   struct scratch_block;  consumer shared memory that outlives a stage (may be empty)
//   struct state;          per-consumer-warpgroup registers kept across a task's iterations
//   static bool setup(task&, const globals&)     fill t.coord/t.iters (>= 1) for t.id; false: no such task
//   static void load(input_block&, semaphore& arrived, const globals&, const task&, int iter)
//        one producer thread: expect_bytes(arrived, bytes) and issue the TMA loads for iteration iter
//   static void compute(state&, input_block&, scratch_block&, const globals&, const task&, int iter)
//        each consumer warpgroup (index lcsf::consumer_id()); must finish reading the block
//        (e.g. mma_async_wait) before returning: the stage is handed back to the producer then
//   static void store(state&, scratch_block&, const globals&, const task&)   consumers, after the last iteration
//   static void finish(scratch_block&, const globals&)   optional: consumers, after the last task
//   static constexpr int RELEASE_LAG = 1;   optional (default 0): compute may leave its last wgmma group
//        in flight (mma_async_wait<1>); a stage is then handed back one iteration later, and after a
//        task's last iteration the template waits for all wgmma groups before store. Needs >= 2 stages.
#pragma once
#include "common.cuh"
#include "grid.cuh"
#include "sync/semaphore.cuh"
#include "ops/warpgroup/mma.cuh"

namespace tk::lcsf {

struct task {
    int id;
    int iters;      // input blocks this task consumes (>= 1)
    int coord[5];   // kernel-defined (e.g. row tile, col tile)
};

TK_DEVICE int consumer_id() { return warpgroupid(); }  // consumers are warpgroups 0 .. CONSUMER_WARPGROUPS-1

template <class K> constexpr int num_threads = (K::CONSUMER_WARPGROUPS + 1) * WARPGROUP_THREADS;
template <class K> constexpr size_t shared_bytes =
    1024 /* alignment slack */ + sizeof(typename K::input_block) * K::INPUT_PIPE_STAGES + sizeof(typename K::scratch_block);

template <class K> concept has_finish = requires(typename K::scratch_block& s, const typename K::globals& g) { K::finish(s, g); };
template <class K> constexpr int release_lag() {
    if constexpr (requires { K::RELEASE_LAG; }) return K::RELEASE_LAG;
    else return 0;
}

template <class K> __global__ void __launch_bounds__(num_threads<K>, 1) kernel(const __grid_constant__ typename K::globals g) {
    constexpr int STAGES = K::INPUT_PIPE_STAGES, CONSUMERS = K::CONSUMER_WARPGROUPS, LAG = release_lag<K>();
    static_assert(LAG == 0 || (LAG == 1 && STAGES >= 2), "RELEASE_LAG is 0, or 1 with at least 2 stages");
    static_assert(STAGES >= 1 && CONSUMERS >= 1 && CONSUMERS <= 3, "1..3 consumer warpgroups, >= 1 stage");
    static_assert(K::PRODUCER_REGS % 8 == 0 && K::CONSUMER_REGS % 8 == 0 && K::PRODUCER_REGS >= 24 && K::CONSUMER_REGS <= 256,
                  "setmaxnreg counts are multiples of 8 in [24, 256]");
    static_assert(K::PRODUCER_REGS * WARPGROUP_THREADS + K::CONSUMER_REGS * WARPGROUP_THREADS * CONSUMERS <= 65536,
                  "register budget exceeds the SM's 64K registers");
    extern __shared__ char smem_raw[];
    char* smem = align_shared<1024>(smem_raw);
    auto* inputs = reinterpret_cast<typename K::input_block*>(smem);
    auto* scratch = reinterpret_cast<typename K::scratch_block*>(smem + sizeof(typename K::input_block) * STAGES);
    __shared__ semaphore arrived[STAGES], finished[STAGES];
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            init_semaphore(arrived[s], 1);                             // the producer's expect_bytes
            init_semaphore(finished[s], CONSUMERS * WARPGROUP_WARPS);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroupid() == CONSUMERS) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(K::PRODUCER_REGS));
        if (threadIdx.x % WARPGROUP_THREADS == 0) {
            int stage = 0, phase = 0;
            for (task t{int(blockIdx.x)}; K::setup(t, g); t = task{t.id + int(gridDim.x)}) {
                for (int it = 0; it < t.iters; ++it) {
                    wait(finished[stage], phase ^ 1);  // a fresh barrier counts its "previous" phase as done
                    K::load(inputs[stage], arrived[stage], g, t, it);
                    if (++stage == STAGES) stage = 0, phase ^= 1;
                }
            }
        }
    } else {  // consumers
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(K::CONSUMER_REGS));
        int stage = 0, phase = 0, previous = 0;
        typename K::state s;
        for (task t{int(blockIdx.x)}; K::setup(t, g); t = task{t.id + int(gridDim.x)}) {
            for (int it = 0; it < t.iters; ++it) {
                wait(arrived[stage], phase);
                K::compute(s, inputs[stage], *scratch, g, t, it);
                if constexpr (LAG == 0) {
                    if (laneid() == 0) arrive(finished[stage]);
                } else {  // compute(it) waited for the wgmmas of it - 1: that stage is free now
                    if (it > 0 && laneid() == 0) arrive(finished[previous]);
                    previous = stage;
                }
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
            if constexpr (LAG != 0) {
                warpgroup::mma_async_wait<0>();
                if (laneid() == 0) arrive(finished[previous]);
            }
            K::store(s, *scratch, g, t);
        }
        if constexpr (has_finish<K>) K::finish(*scratch, g);
    }
}

// Launch on `stream` with one block per SM (at most `tasks` blocks). Returns the launch status.
template <class K> cudaError_t launch(const typename K::globals& g, int tasks, cudaStream_t stream) {
    constexpr size_t bytes = shared_bytes<K>;
    // (the block's static shared memory, its semaphores, counts against the same 227 KB)
    static_assert(bytes + 2 * K::INPUT_PIPE_STAGES * sizeof(semaphore) <= 227 * 1024,
                  "LCSF kernel needs more than the 227 KB of shared memory a block may have");
    cudaError_t e = cudaFuncSetAttribute(kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e != cudaSuccess) return e;
    kernel<K><<<grid::persistent_blocks(tasks), num_threads<K>, bytes, stream>>>(g);
    return cudaGetLastError();
}

}  // namespace tk::lcsf
