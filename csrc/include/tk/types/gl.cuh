// Global views: 4-D (batch, depth, rows, cols) views of device memory, each dim compile-time
// (template value > 0) or run-time (-1); the innermost dim is contiguous, the outer three have
// element strides. tma_map<ST> is a TMA descriptor for moving ST-shaped boxes of such a view,
// made on the host with cuTensorMapEncodeTiled fetched through the runtime's driver entry point
// (so nothing links against libcuda).
#pragma once
#include <cuda.h>
#include "st.cuh"

namespace tk {

template <tile_scalar T_, int B_ = -1, int H_ = -1, int R_ = -1, int C_ = -1> struct gl {
    using T = T_;
    T* raw;
    int dims[4];           // batch, depth, rows, cols
    long long strides[3];  // batch, depth, row strides in elements (the col stride is 1)

    // Contiguous view.
    TK_HOST_DEVICE gl(T* p, int b, int h, int r, int c)
        : raw(p), dims{B_ > 0 ? B_ : b, H_ > 0 ? H_ : h, R_ > 0 ? R_ : r, C_ > 0 ? C_ : c},
          strides{(long long)dims[1] * dims[2] * dims[3], (long long)dims[2] * dims[3], (long long)dims[3]} {}
    // Strided view (strides in elements).
    TK_HOST_DEVICE gl(T* p, int b, int h, int r, int c, long long sb, long long sh, long long sr)
        : raw(p), dims{B_ > 0 ? B_ : b, H_ > 0 ? H_ : h, R_ > 0 ? R_ : r, C_ > 0 ? C_ : c}, strides{sb, sh, sr} {}
    // True when run-time sizes agree with the compile-time ones (check on the host before launching).
    static bool matches(int b, int h, int r, int c) {
        return (B_ <= 0 || B_ == b) && (H_ <= 0 || H_ == h) && (R_ <= 0 || R_ == r) && (C_ <= 0 || C_ == c);
    }
    TK_HOST_DEVICE int batch() const { if constexpr (B_ > 0) return B_; else return dims[0]; }
    TK_HOST_DEVICE int depth() const { if constexpr (H_ > 0) return H_; else return dims[1]; }
    TK_HOST_DEVICE int rows() const { if constexpr (R_ > 0) return R_; else return dims[2]; }
    TK_HOST_DEVICE int cols() const { if constexpr (C_ > 0) return C_; else return dims[3]; }
    TK_HOST_DEVICE long long row_stride() const { return strides[2]; }
    // Pointer to (b, h, r, 0).
    TK_HOST_DEVICE T* row_ptr(int b, int h, int r) const { return raw + b * strides[0] + h * strides[1] + r * strides[2]; }
    TK_HOST_DEVICE T& operator()(int b, int h, int r, int c) const { return row_ptr(b, h, r)[c]; }
};

// Tile coordinate: batch, depth, and row/col in units of the moved tile's rows/cols.
struct coord {
    int b, h, r, c;
};

template <shared_tile ST> struct tma_map {
    CUtensorMap map;
};

namespace detail {
template <class T> constexpr CUtensorMapDataType tma_dtype() {
    if constexpr (std::is_same_v<T, bf16>) return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    else if constexpr (std::is_same_v<T, half>) return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    else return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}
using encode_tiled_fn = decltype(&cuTensorMapEncodeTiled);
inline encode_tiled_fn encode_tiled() {
    static encode_tiled_fn fn = [] {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult q{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            return encode_tiled_fn(nullptr);
        return reinterpret_cast<encode_tiled_fn>(p);
    }();
    return fn;
}
}  // namespace detail

// Fill `out` with a descriptor moving ST boxes of view g. Returns nullptr on success, else why not.
// Out-of-range parts of a box read as zeros and are not written, so tails need no special case.
template <shared_tile ST, class GL> const char* make_tma_map(tma_map<ST>& out, const GL& g) {
    using T = typename ST::T;
    static_assert(std::is_same_v<T, typename GL::T>, "tile and view element types differ");
    static_assert(ST::rows <= 256 && ST::block_cols <= 256, "a TMA box is at most 256 per dim");
    auto encode = detail::encode_tiled();
    if (!encode) return "cuTensorMapEncodeTiled is unavailable (driver too old?)";
    if (reinterpret_cast<uintptr_t>(g.raw) % 16) return "TMA needs a 16-byte aligned base address";
    cuuint64_t dims[4] = {cuuint64_t(g.cols()), cuuint64_t(g.rows()), cuuint64_t(g.depth()), cuuint64_t(g.batch())};
    cuuint64_t strides[3];
    for (int i = 0; i < 3; ++i) {
        const cuuint64_t bytes = cuuint64_t(g.strides[2 - i]) * sizeof(T);
        // The stride of a size-1 dim is never used: any multiple of 16 will do.
        if (dims[i + 1] == 1) strides[i] = (bytes + 15) / 16 * 16;
        else if (bytes % 16) return "TMA needs strides that are multiples of 16 bytes";
        else strides[i] = bytes;
    }
    cuuint32_t box[4] = {cuuint32_t(ST::block_cols), cuuint32_t(ST::rows), 1, 1};
    cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    constexpr CUtensorMapSwizzle swizzle = ST::swizzle_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                           : ST::swizzle_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                           : ST::swizzle_bytes == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                                     : CU_TENSOR_MAP_SWIZZLE_NONE;
    CUresult r = encode(&out.map, detail::tma_dtype<T>(), 4, g.raw, dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled rejected the view (sizes, strides or alignment)";
}

}  // namespace tk
