// bf16 GEMM on the LCSF template: the proof that the tile library reaches cuBLAS-class speed.
// Block tile 128 x 256 x 64: two consumer warpgroups each own 64 x 256 fp32 accumulators
// (wgmma m64n256k16, A and B straight from swizzled shared memory); one producer thread streams
// A and B tiles by TMA into a ring of STAGES buffers. Persistent grid, supergrouped tile order.
// Tails: TMA zero-fills out-of-range loads (so a short K block adds zeros); the epilogue drops
// out-of-range rows/cols. Two epilogues: bounds-checked stores straight from registers (any N, no
// shared memory, so 4 stages fit), or TMA_STORE: registers -> bf16 shared tile -> TMA store, which
// frees the consumers as soon as the tile is in shared memory (64 KB more shared memory: <= 3 stages).
// OVERLAP keeps one k-block of wgmmas in flight per consumer (LCSF RELEASE_LAG = 1).
#include "gemm.cuh"
#include <variant>
#include <tk/tk.cuh>

namespace tk_kernels {
namespace {

using namespace tk;

template <int STAGES, bool TMA_STORE, bool OVERLAP> struct gemm_kernel {
    static constexpr int CONSUMER_WARPGROUPS = 2, INPUT_PIPE_STAGES = STAGES, RELEASE_LAG = OVERLAP;
    static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
    static constexpr int BM = 64 * CONSUMER_WARPGROUPS, BN = 256, BK = 64, SUPERGROUP = 8;
    using a_tile = st<bf16, 64, BK>;
    using b_tile = st<bf16, BK, BN>;
    using c_tile = st<bf16, 64, BN>;
    using view = gl<bf16>;
    struct globals {
        tma_map<a_tile> a;
        tma_map<b_tile> b;
        tma_map<c_tile> c_map;  // TMA_STORE only
        view c;
        int row_tiles, col_tiles, k_iters;
    };
    struct input_block {
        a_tile a[CONSUMER_WARPGROUPS];
        b_tile b;
    };
    struct staged_output {
        c_tile c[CONSUMER_WARPGROUPS];
    };
    struct scratch_block : std::conditional_t<TMA_STORE, staged_output, std::monostate> {};
    struct state {
        rt_fl<16, BN> acc;
    };

    __device__ static bool setup(lcsf::task& t, const globals& g) {
        const auto ix = grid::supergroup(t.id, g.row_tiles, g.col_tiles, SUPERGROUP);
        if (ix.row < 0) return false;
        t.coord[0] = ix.row, t.coord[1] = ix.col, t.iters = g.k_iters;
        return true;
    }
    __device__ static void load(input_block& in, semaphore& arrived, const globals& g, const lcsf::task& t, int it) {
        expect_bytes(arrived, sizeof(input_block));
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPGROUPS; ++w)
            tma::load_async(in.a[w], g.a, arrived, {0, 0, t.coord[0] * CONSUMER_WARPGROUPS + w, it});
        tma::load_async(in.b, g.b, arrived, {0, 0, it, t.coord[1]});
    }
    __device__ static void compute(state& s, input_block& in, scratch_block&, const globals&, const lcsf::task&, int it) {
        warpgroup::mma_AB(s.acc, in.a[lcsf::consumer_id()], in.b, it > 0);
        warpgroup::mma_async_wait<OVERLAP ? 1 : 0>(s.acc);  // OVERLAP: keep this block's wgmmas running
    }
    __device__ static void store(state& s, scratch_block& sc, const globals& g, const lcsf::task& t) {
        const int wg = lcsf::consumer_id();
        const coord at{0, 0, t.coord[0] * CONSUMER_WARPGROUPS + wg, t.coord[1]};
        if constexpr (TMA_STORE) {
            const bool leader = threadIdx.x % WARPGROUP_THREADS == 0;
            if (leader) tma::store_read_wait<0>();  // the previous task's store has read the staging tile
            warpgroup::sync(1 + wg);
            rt_bf<16, BN> out;
            copy(out, s.acc);
            warpgroup::store(sc.c[wg], out);
            fence_async_shared();
            warpgroup::sync(1 + wg);
            if (leader) {
                tma::store_async(g.c_map, sc.c[wg], at);
                tma::store_commit();
            }
        } else {
            warpgroup::store(g.c, s.acc, at);
        }
    }
    __device__ static void finish(scratch_block&, const globals&) {
        if (TMA_STORE && threadIdx.x % WARPGROUP_THREADS == 0) tma::store_wait<0>();
    }
};

template <int STAGES, bool TMA_STORE, bool OVERLAP>
const char* run(const bf16* a, const bf16* b, bf16* c, int M, int N, int K, long long lda, long long ldb, long long ldc,
                cudaStream_t stream) {
    using G = gemm_kernel<STAGES, TMA_STORE, OVERLAP>;
    typename G::globals g{{}, {}, {}, typename G::view(c, 1, 1, M, N, 0, 0, ldc), (M + G::BM - 1) / G::BM,
                          (N + G::BN - 1) / G::BN, (K + G::BK - 1) / G::BK};
    if (const char* e = make_tma_map(g.a, gl<bf16>(const_cast<bf16*>(a), 1, 1, M, K, 0, 0, lda))) return e;
    if (const char* e = make_tma_map(g.b, gl<bf16>(const_cast<bf16*>(b), 1, 1, K, N, 0, 0, ldb))) return e;
    if constexpr (TMA_STORE)
        if (const char* e = make_tma_map(g.c_map, g.c)) return e;
    const cudaError_t e = lcsf::launch<G>(g, g.row_tiles * g.col_tiles, stream);
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

template <bool TMA_STORE, bool OVERLAP>
const char* run_stages(const bf16* a, const bf16* b, bf16* c, int M, int N, int K, long long lda, long long ldb,
                       long long ldc, int stages, cudaStream_t stream) {
    switch (stages) {
        case 1:
            if constexpr (!OVERLAP) return run<1, TMA_STORE, OVERLAP>(a, b, c, M, N, K, lda, ldb, ldc, stream);
            else return "gemm: overlap needs >= 2 stages";
        case 2: return run<2, TMA_STORE, OVERLAP>(a, b, c, M, N, K, lda, ldb, ldc, stream);
        case 3: return run<3, TMA_STORE, OVERLAP>(a, b, c, M, N, K, lda, ldb, ldc, stream);
        case 4:
            if constexpr (!TMA_STORE) return run<4, TMA_STORE, OVERLAP>(a, b, c, M, N, K, lda, ldb, ldc, stream);
            else return "gemm: the TMA-store epilogue fits 1..3 stages";
        default: return "gemm: stages must be 1..4";
    }
}

}  // namespace

const char* gemm_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* c, int M, int N, int K, long long lda,
                      long long ldb, long long ldc, gemm_config cfg, cudaStream_t stream) {
    if (M < 1 || N < 1 || K < 1) return "gemm: M, N, K must be >= 1";
    if (cfg.tma_store)
        return cfg.overlap ? run_stages<true, true>(a, b, c, M, N, K, lda, ldb, ldc, cfg.stages, stream)
                           : run_stages<true, false>(a, b, c, M, N, K, lda, ldb, ldc, cfg.stages, stream);
    return cfg.overlap ? run_stages<false, true>(a, b, c, M, N, K, lda, ldb, ldc, cfg.stages, stream)
                       : run_stages<false, false>(a, b, c, M, N, K, lda, ldb, ldc, cfg.stages, stream);
}

}  // namespace tk_kernels
