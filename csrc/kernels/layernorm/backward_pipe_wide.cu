// Backward, persistent "pipe" variants 4..11 (the kernel is in backward_pipe.cuh; backward_pipe.cu
// dispatches here after mapping the hidden sizes where they equal variant 3 to it).
#include "backward_pipe.cuh"

namespace tk_layernorm {
namespace {

template <typename F>
cudaError_t with_wide_variant(const BackwardArgs& args, DType dtype, F&& f) {
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    switch (args.variant) {
      // 4 vectors per thread (a warp per row up to hidden 1024: no block barrier per row), 128-thread
      // blocks, <= 170 registers (3 blocks, 384 threads per SM); 3 or 2 stages.
      case 4: return with_pipe_split<true, 4, 128>(args.hidden, [&](auto s) { return pick<T, decltype(s), 3, 384, false>(args, f); });
      case 5: return with_pipe_split<true, 4, 128>(args.hidden, [&](auto s) { return pick<T, decltype(s), 2, 384, false>(args, f); });
      // Variant 3's splits at hidden 513..2048 (several rows of 2 or 4 warps per block), row-group barriers.
      case 6:
        if (args.hidden <= 512 || args.hidden > 2048) return cudaErrorInvalidValue;  // effective_variant: 3
        if (args.hidden <= 1024) return pick<T, Split<64, 2>, 3, 512, true>(args, f);
        return pick<T, Split<128, 2>, 3, 512, true>(args, f);
      // Variant 3 with the row in registers between its two passes and w in fp32 registers (KEEP), up to
      // hidden 8192 (past it a block of 1024 threads has 64 registers: effective_variant gives 3).
      case 7:
        return with_pipe_split<true, 2>(args.hidden, [&](auto s) {
          using S = decltype(s);
          return pick<T, S, 3, 512, false, (S::BLOCK <= 512)>(args, f);
        });
      // 8, 9: variant 7 in blocks of at least 128 threads (8: two rows of 64 at hidden 1024, 4 blocks per SM) or
      // of one row (9: 8 blocks of 64 threads per SM at 1024): smaller barrier domains, more blocks to even out
      // the SMs, at the cost of more dw/db partial rows (one per block: 8.6 MB at every size for 9).
      case 8:
        return with_pipe_split<true, 2, 128>(args.hidden, [&](auto s) {
          using S = decltype(s);
          return pick<T, S, 3, 512, false, (S::BLOCK <= 512)>(args, f);
        });
      case 9:
        return with_pipe_split<true, 2, 32>(args.hidden, [&](auto s) {
          using S = decltype(s);
          return pick<T, S, 3, 512, false, (S::BLOCK <= 512)>(args, f);
        });
      // 10: variant 8, LEAN. 11: 10 with at most 256 resident threads per SM (two 128-thread blocks at hidden
      // <= 2048; one block above): on the H200 at hidden 1024 the grid moved its bytes faster with 2 blocks
      // per SM than with 3 or 4 (and with 3 or more stages alike), and its column sum has half the rows.
      case 10:
      case 11:
        return with_pipe_split<true, 2, 128>(args.hidden, [&](auto s) {
          using S = decltype(s);
          const int per_sm = args.variant == 11 ? (S::BLOCK < 256 ? 256 / S::BLOCK : 1) : 0;
          return pick<T, S, 3, 512, false, (S::BLOCK <= 512), (S::BLOCK <= 512)>(args, f, per_sm);
        });
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace

namespace pipe_wide {

int backward_blocks(const BackwardArgs& args, DType dtype) {
  int blocks = 0;
  with_wide_variant(args, dtype, [&](auto kernel, size_t smem, int block, int rows_per_block, auto stages) {
    blocks = persistent_grid<decltype(stages)::value>(kernel, block, smem, args.rows, rows_per_block);
    return cudaSuccess;
  });
  return blocks;
}

cudaError_t backward(const BackwardArgs& args, DType dtype, int blocks, cudaStream_t stream) {
  return with_wide_variant(args, dtype, [&](auto kernel, size_t smem, int block, int, auto) {
    return tk::grid::launch_dependent(kernel, blocks, block, smem, stream, args);
  });
}

}  // namespace pipe_wide
}  // namespace tk_layernorm
