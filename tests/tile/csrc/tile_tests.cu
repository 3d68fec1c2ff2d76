// Unit-test kernels for csrc/include/tk: each exercises one group of tile ops; the Python side
// (tests/test_tile_gpu.py) compares against PyTorch.
#include "tile_tests.cuh"
#include <tk/tk.cuh>
#include <tk/ops/warp/mma.cuh>

namespace tk_tests {
using namespace tk;

namespace {
constexpr int R = 32, C = 48;

template <class T, class L> __global__ void tile_op_kernel(const float* x, const float* y, float* out, float* vout, int rows,
                                                           int cols, int op) {
    using tile = rt<T, R, C, L>;
    gl<float> gx(const_cast<float*>(x), 1, 1, rows, cols), gy(const_cast<float*>(y), 1, 1, rows, cols);
    gl<float> go(out, 1, 1, rows, cols), gt(out, 1, 1, cols, rows);
    tile a, b, d;
    load(a, gx, {0, 0, 0, 0});
    load(b, gy, {0, 0, 0, 0});
    row_vec<tile, float> rv1;
    col_vec<tile, float> cv1;
    switch (op) {
        case 0: copy(d, a); break;
        case 1: exp2(d, a); break;
        case 2: mul(d, a, b); break;
        case 3: add(d, a, 1.5f); break;
        case 4: max(d, a, b); break;
        case 5: row_max(rv1, a); sub_row(d, a, rv1); break;
        case 6: col_sum(cv1, a); div_col(d, a, cv1); break;
        case 7: row_sum(rv1, b); mul_row(d, a, rv1); break;
        case 8: col_max(cv1, b); add_col(d, a, cv1); break;
        case 9: {  // shared round trip, 48-wide tile (bf16: 32-byte swizzle, fp32: 64-byte)
            __shared__ st<T, R, C> s;
            store(s, a);
            __syncwarp();
            load(d, s);
            break;
        }
        case 10: {  // shared round trip at a column offset inside a 64-wide tile (128-byte swizzle)
            __shared__ st<T, R, 64> s;
            store(s, a, 0, 16);
            __syncwarp();
            load(d, s, 0, 16);
            break;
        }
        case 11: {  // layout swap: store the other-layout tile (global store handles both layouts)
            rt<T, R, C, std::conditional_t<tile::is_row, col_layout, row_layout>> o;
            swap_layout(o, a);
            store(go, o, {0, 0, 0, 0});
            return;
        }
        case 12: {  // transpose (same layout) and transpose_sep (other layout): out = xᵀ
            rt<T, C, R, L> t;
            transpose(t, a);
            store(gt, t, {0, 0, 0, 0});
            return;
        }
        case 13: {
            rt<T, C, R, std::conditional_t<tile::is_row, col_layout, row_layout>> t;
            transpose_sep(t, a);
            store(gt, t, {0, 0, 0, 0});
            return;
        }
        case 14: {  // fp32 -> bf16 -> fp32 conversion (rounding)
            rt<bf16, R, C, L> h;
            copy(h, a);
            copy(d, h);
            break;
        }
        case 15: {  // online-softmax step: m = rowmax(a) folded with rowmax(b); d = exp2(a - m)
            row_vec<tile, float> m0;
            row_max(m0, b);
            row_max(rv1, a, m0);
            sub_row(d, a, rv1);
            exp2(d, d);
            break;
        }
        case 16: {  // vector maps: d = a * exp(rowmax(a) - rowsum(b))
            row_vec<tile, float> s;
            row_max(rv1, a);
            row_sum(s, b);
            sub(rv1, rv1, s);
            exp(rv1, rv1);
            mul_row(d, a, rv1);
            break;
        }
        case 17: {  // shared vectors: row max through sv and back, broadcast
            __shared__ sv<float, R> v;
            row_max(rv1, a);
            store(v, rv1);
            __syncwarp();
            row_vec<tile, float> r2;
            load(r2, v);
            broadcast_row(d, r2);
            break;
        }
        case 18:  // map_indexed: keep a on and below the diagonal, mark the rest by row
            map_indexed(d, a, [](int r, int c, float v) { return c <= r ? v : -0.5f * float(r % 3); });
            break;
        case 19:  // shuffle broadcasts (16-bit row layout): per base tile, d(r, c) = a(r, 5) * a(11, c)
            if constexpr (sizeof(T) == 2 && tile::is_row) {
#pragma unroll
                for (int i = 0; i < tile::height; ++i)
#pragma unroll
                    for (int w = 0; w < tile::width; ++w) {
                        const auto& t = a.tiles[i][w];
                        const packed_t<T> c0 = column_at<5, 0>(t), c1 = column_at<5, 1>(t);
                        const packed_t<T> r0 = row_pair_at<1, 0>(t, 3), r1 = row_pair_at<1, 1>(t, 3);
#pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            const packed_t<T> cf = k & 1 ? c1 : c0, rf = k >> 1 ? r1 : r0;
                            d.tiles[i][w].data[k].x = convert<T>(convert<float>(cf.x) * convert<float>(rf.x));
                            d.tiles[i][w].data[k].y = convert<T>(convert<float>(cf.y) * convert<float>(rf.y));
                        }
                    }
            } else {
                copy(d, a);  // (not tested: the broadcasts take 16-bit row-layout tiles)
            }
            break;
        case 20: row_max(rv1, a); store(gl<float>(vout, 1, 1, 1, rows), rv1, {0, 0, 0, 0}); return;
        case 21: row_sum(rv1, a); store(gl<float>(vout, 1, 1, 1, rows), rv1, {0, 0, 0, 0}); return;
        case 22: col_max(cv1, a); store(gl<float>(vout, 1, 1, 1, cols), cv1, {0, 0, 0, 0}); return;
        case 23: col_sum(cv1, a); store(gl<float>(vout, 1, 1, 1, cols), cv1, {0, 0, 0, 0}); return;
        case 24: row_min(rv1, a); store(gl<float>(vout, 1, 1, 1, rows), rv1, {0, 0, 0, 0}); return;
        default: return;
    }
    store(go, d, {0, 0, 0, 0});
}

template <class T, class L> const char* tile_op_launch(const float* x, const float* y, float* out, float* vout, int rows,
                                                       int cols, int op, cudaStream_t s) {
    tile_op_kernel<T, L><<<1, 32, 0, s>>>(x, y, out, vout, rows, cols, op);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// ---- wgmma ----
template <class T, int N, int K, int V> __global__ void __launch_bounds__(128) wgmma_kernel(const T* a, const T* b, float* d,
                                                                                          bool accumulate) {
    constexpr bool at = V == 2 || V == 3, bt = V == 1 || V == 3 || V == 5;
    using a_tile = std::conditional_t<at, st<T, K, 64>, st<T, 64, K>>;
    using b_tile = std::conditional_t<bt, st<T, N, K>, st<T, K, N>>;
    extern __shared__ char raw[];
    char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    a_tile& sa = *reinterpret_cast<a_tile*>(base);
    b_tile& sb = *reinterpret_cast<b_tile*>(base + sizeof(a_tile));
    for (int i = threadIdx.x; i < a_tile::rows * a_tile::cols; i += 128) sa(i / a_tile::cols, i % a_tile::cols) = a[i];
    for (int i = threadIdx.x; i < b_tile::rows * b_tile::cols; i += 128) sb(i / b_tile::cols, i % b_tile::cols) = b[i];
    fence_async_shared();  // ordinary stores above, wgmma reads below
    __syncthreads();
    gl<float> gd(d, 1, 1, 64, N);
    rt<float, 16, N> acc;
    warpgroup::load(acc, gd, {0, 0, 0, 0});
    if constexpr (V >= 4) {
        rt<T, 16, K> ra;
        warpgroup::load(ra, sa);
        if constexpr (V == 4) warpgroup::mma_AB(acc, ra, sb, accumulate);
        else warpgroup::mma_ABt(acc, ra, sb, accumulate);
    } else if constexpr (V == 0) warpgroup::mma_AB(acc, sa, sb, accumulate);
    else if constexpr (V == 1) warpgroup::mma_ABt(acc, sa, sb, accumulate);
    else if constexpr (V == 2) warpgroup::mma_AtB(acc, sa, sb, accumulate);
    else warpgroup::mma_AtBt(acc, sa, sb, accumulate);
    warpgroup::mma_async_wait<0>(acc);
    warpgroup::store(gd, acc, {0, 0, 0, 0});
}

template <class T, int N, int K> const char* wgmma_shape(const void* a, const void* b, float* d, int variant, bool acc,
                                                         cudaStream_t s) {
    constexpr int bytes = 1024 + (64 * K + N * K) * sizeof(T);
    auto go = [&](auto kernel) -> const char* {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
        kernel<<<1, 128, bytes, s>>>(static_cast<const T*>(a), static_cast<const T*>(b), d, acc);
        const cudaError_t e = cudaGetLastError();
        return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
    };
    switch (variant) {
        case 0: return go(wgmma_kernel<T, N, K, 0>);
        case 1: return go(wgmma_kernel<T, N, K, 1>);
        case 2: return go(wgmma_kernel<T, N, K, 2>);
        case 3: return go(wgmma_kernel<T, N, K, 3>);
        case 4: return go(wgmma_kernel<T, N, K, 4>);
        case 5: return go(wgmma_kernel<T, N, K, 5>);
        default: return "variant must be 0..5";
    }
}

// ---- warp mma (mma.sync) ----
// One warp: d (32 x 48 fp32) = a (32 x 32) · b + c, b given K x N (variant 0: mma_AB, loaded in col layout by
// ldmatrix.trans) or N x K (variant 1: mma_ABt, row layout).
template <class T, int V> __global__ void __launch_bounds__(32) warp_mma_kernel(const T* a, const T* b, float* d) {
    constexpr int M = 32, N = 48, K = 32;
    using b_tile = std::conditional_t<V == 0, st<T, K, N>, st<T, N, K>>;
    __shared__ st<T, M, K> sa;
    __shared__ b_tile sb;
    for (int i = threadIdx.x; i < M * K; i += 32) sa(i / K, i % K) = a[i];
    for (int i = threadIdx.x; i < b_tile::rows * b_tile::cols; i += 32) sb(i / b_tile::cols, i % b_tile::cols) = b[i];
    __syncwarp();
    rt<T, M, K> ra;
    load(ra, sa);
    gl<float> gd(d, 1, 1, M, N);
    rt_fl<M, N> acc;
    load(acc, gd, {0, 0, 0, 0});
    if constexpr (V == 0) {
        rt<T, K, N, col_layout> rb;
        load(rb, sb);
        mma_AB(acc, ra, rb, acc);
    } else {
        rt<T, N, K> rb;
        load(rb, sb);
        mma_ABt(acc, ra, rb, acc);
    }
    store(gd, acc, {0, 0, 0, 0});
}

// ---- TMA ----
template <class ST> __global__ void tma_kernel(const __grid_constant__ tma_map<ST> in_map, const __grid_constant__ tma_map<ST> out_map,
                                               gl<typename ST::T> x, gl<typename ST::T> out1, int row_tiles, int col_tiles) {
    using T = typename ST::T;
    extern __shared__ char raw[];
    char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    ST& s = *reinterpret_cast<ST*>(base);
    ST& s2 = *reinterpret_cast<ST*>(base + sizeof(ST));
    __shared__ semaphore bar;
    const int rt_ = blockIdx.x % row_tiles, ct = blockIdx.x / row_tiles, h = blockIdx.y, b = blockIdx.z;
    if (threadIdx.x == 0) {
        init_semaphore(bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        expect_bytes(bar, ST::bytes);
        tma::load_async(s, in_map, bar, {b, h, rt_, ct});
    }
    wait(bar, 0);
    for (int i = threadIdx.x; i < ST::rows * ST::cols; i += blockDim.x) {
        const int r = rt_ * ST::rows + i / ST::cols, c = ct * ST::cols + i % ST::cols;
        if (r < x.rows() && c < x.cols()) {
            out1(b, h, r, c) = s(i / ST::cols, i % ST::cols);
            s2(i / ST::cols, i % ST::cols) = convert<T>(2.f * convert<float>(x(b, h, r, c)));
        } else {
            s2(i / ST::cols, i % ST::cols) = convert<T>(-7.f);  // must never reach memory
        }
    }
    fence_async_shared();
    __syncthreads();
    if (threadIdx.x == 0) {
        tma::store_async(out_map, s2, {b, h, rt_, ct});
        tma::store_commit();
        tma::store_wait<0>();
    }
}

template <class ST> const char* tma_launch(const void* x, void* out1, void* out2, int b, int h, int rows, int cols, cudaStream_t s) {
    using T = typename ST::T;
    gl<T> gx(static_cast<T*>(const_cast<void*>(x)), b, h, rows, cols), g1(static_cast<T*>(out1), b, h, rows, cols),
        g2(static_cast<T*>(out2), b, h, rows, cols);
    tma_map<ST> mi, mo;
    if (const char* e = make_tma_map(mi, gx)) return e;
    if (const char* e = make_tma_map(mo, g2)) return e;
    const int row_tiles = (rows + ST::rows - 1) / ST::rows, col_tiles = (cols + ST::cols - 1) / ST::cols;
    constexpr int bytes = 1024 + 2 * sizeof(ST);
    cudaFuncSetAttribute(tma_kernel<ST>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    tma_kernel<ST><<<dim3(row_tiles * col_tiles, h, b), 128, bytes, s>>>(mi, mo, gx, g1, row_tiles, col_tiles);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// ---- bank conflicts: ldmatrix loads of a 64 x 64 bf16 tile, swizzled (128 B) or plain ----
template <int Swizzle> __global__ void __launch_bounds__(128) smem_load_kernel(float* out, int iters) {
    __shared__ st<bf16, 64, 64, Swizzle> s;
    rt<bf16, 16, 64> r;
    for (int i = threadIdx.x; i < 64 * 64; i += 128) s(i / 64, i % 64) = convert<bf16>(float(i % 97));
    __syncthreads();
    rt<float, 16, 64> acc;
    zero(acc);
    for (int it = 0; it < iters; ++it) {
        warpgroup::load(r, s);
        rt<float, 16, 64> f;
        copy(f, r);
        add(acc, acc, f);
    }
    gl<float> g(out, 1, 1, 64, 64);
    warpgroup::store(g, acc, {0, 0, 0, 0});
}
}  // namespace

const char* tile_op(const float* x, const float* y, float* out, float* vout, int rows, int cols, int op, int reg, bool col,
                    cudaStream_t s) {
    if (rows < 1 || rows > R || cols < 1 || cols > C) return "tile_op: rows <= 32 and cols <= 48";
    if (reg == 0) return col ? tile_op_launch<float, col_layout>(x, y, out, vout, rows, cols, op, s)
                             : tile_op_launch<float, row_layout>(x, y, out, vout, rows, cols, op, s);
    if (reg == 1) return col ? tile_op_launch<bf16, col_layout>(x, y, out, vout, rows, cols, op, s)
                             : tile_op_launch<bf16, row_layout>(x, y, out, vout, rows, cols, op, s);
    return col ? tile_op_launch<half, col_layout>(x, y, out, vout, rows, cols, op, s)
               : tile_op_launch<half, row_layout>(x, y, out, vout, rows, cols, op, s);
}

const char* warp_mma_op(const void* a, const void* b, float* d, int variant, bool fp16, cudaStream_t s) {
    auto go = [&](auto kernel, auto* t) -> const char* {
        using T = std::remove_pointer_t<decltype(t)>;
        kernel<<<1, 32, 0, s>>>(static_cast<const T*>(a), static_cast<const T*>(b), d);
        const cudaError_t e = cudaGetLastError();
        return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
    };
    if (variant != 0 && variant != 1) return "variant must be 0 (AB) or 1 (ABt)";
    if (fp16) return variant ? go(warp_mma_kernel<half, 1>, (half*)nullptr) : go(warp_mma_kernel<half, 0>, (half*)nullptr);
    return variant ? go(warp_mma_kernel<bf16, 1>, (bf16*)nullptr) : go(warp_mma_kernel<bf16, 0>, (bf16*)nullptr);
}

const char* wgmma_op(const void* a, const void* b, float* d, int n, int k, int variant, bool fp16, bool acc, cudaStream_t s) {
    if (fp16) {
        if (n == 64 && k == 64) return wgmma_shape<half, 64, 64>(a, b, d, variant, acc, s);
        return "fp16 wgmma test shape is n=64, k=64";
    }
    if (n == 64 && k == 64) return wgmma_shape<bf16, 64, 64>(a, b, d, variant, acc, s);
    if (n == 256 && k == 32) return wgmma_shape<bf16, 256, 32>(a, b, d, variant, acc, s);
    if (n == 48 && k == 128) return wgmma_shape<bf16, 48, 128>(a, b, d, variant, acc, s);
    if (n == 16 && k == 16) return wgmma_shape<bf16, 16, 16>(a, b, d, variant, acc, s);
    return "bf16 wgmma test shapes: (n, k) in (64, 64), (256, 32), (48, 128), (16, 16)";
}

const char* tma_roundtrip(const void* x, void* out1, void* out2, int b, int h, int rows, int cols, int tile, cudaStream_t s) {
    switch (tile) {
        case 0: return tma_launch<st<bf16, 64, 64>>(x, out1, out2, b, h, rows, cols, s);
        case 1: return tma_launch<st<bf16, 64, 32>>(x, out1, out2, b, h, rows, cols, s);
        case 2: return tma_launch<st<bf16, 32, 16>>(x, out1, out2, b, h, rows, cols, s);
        case 3: return tma_launch<st<float, 32, 32>>(x, out1, out2, b, h, rows, cols, s);
        case 4: return tma_launch<st<float, 16, 16>>(x, out1, out2, b, h, rows, cols, s);
        case 5: return tma_launch<st<bf16, 64, 64, 0>>(x, out1, out2, b, h, rows, cols, s);
        default: return "tile must be 0..5";
    }
}

const char* smem_load_loop(float* out, bool swizzled, int iters, cudaStream_t s) {
    if (swizzled) smem_load_kernel<128><<<1, 128, 0, s>>>(out, iters);
    else smem_load_kernel<0><<<1, 128, 0, s>>>(out, iters);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace tk_tests
