// Launch functions of the tile-library unit-test kernels (torch-free; see tile_tests.cu).
#pragma once
#include <cuda_runtime.h>

namespace tk_tests {
// Register-tile ops on a 32 x 48 tile (2 x 3 base tiles) loaded with bounds from x, y (rows x cols
// fp32, rows <= 32, cols <= 48). reg: 0 fp32, 1 bf16, 2 fp16 registers; col: col layout.
// op < 20 writes a tile to out (rows x cols, or cols x rows for the transpose), op >= 20 a vector to vout.
const char* tile_op(const float* x, const float* y, float* out, float* vout, int rows, int cols, int op, int reg, bool col,
                    cudaStream_t s);
// One warpgroup: d (64 x n fp32) = op(a) op(b), a and b bf16/fp16 row-major as given
// (a: 64 x k, or k x 64 when transposed; b: k x n, or n x k when transposed).
// variant: 0 AB, 1 ABt, 2 AtB, 3 AtBt, 4 AB with register A, 5 ABt with register A. accumulate adds d's old value.
const char* wgmma_op(const void* a, const void* b, float* d, int n, int k, int variant, bool fp16, bool accumulate,
                     cudaStream_t s);
// One warp: d (32 x 48 fp32, updated in place) += a (32 x 32) · b, mma.sync; b is 32 x 48 (variant 0, AB) or
// 48 x 32 (variant 1, ABt); all row-major.
const char* warp_mma_op(const void* a, const void* b, float* d, int variant, bool fp16, cudaStream_t s);
// TMA round trip over a (batch, depth, rows, cols) tensor in tiles: out1 = x read back element-wise from
// the TMA-loaded shared tile, out2 = 2 * x written by TMA store from an element-wise filled tile.
// tile: 0 bf16 64x64, 1 bf16 64x32, 2 bf16 32x16, 3 fp32 32x32, 4 fp32 16x16, 5 bf16 64x64 unswizzled.
const char* tma_roundtrip(const void* x, void* out1, void* out2, int b, int h, int rows, int cols, int tile, cudaStream_t s);
// Shared->register loads in a loop (for Nsight Compute's bank-conflict counters): swizzled or not.
const char* smem_load_loop(float* out, bool swizzled, int iters, cudaStream_t s);
}  // namespace tk_tests
