// Backward, "pipe" variants 4..11 (the kernel is in backward_pipe.cuh; backward_pipe.cu
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
      // 10, 11: variant 8's kernel on a chunked grid, 32-row chunks, in clusters of 4 (10) or 8 (11) blocks that
      // write one dw/db partial row each (128 / 256 rows a partial: at hidden 1024 as many partials as 8's).
      case 10:
        return with_pipe_split<true, 2, 128>(args.hidden, [&](auto s) {
          using S = decltype(s);
          return pick<T, S, 3, 512, false, (S::BLOCK <= 512), 4>(args, f);
        });
      case 11:
        return with_pipe_split<true, 2, 128>(args.hidden, [&](auto s) {
          using S = decltype(s);
          return pick<T, S, 3, 512, false, (S::BLOCK <= 512), 8>(args, f);
        });
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace

namespace pipe_wide {

constexpr int kChunkRows = 32;  // rows of a chunk in the chunked variants

int backward_partial_rows(const BackwardArgs& args, DType dtype) {
  int partials = 0;
  with_wide_variant(args, dtype, [&](auto kernel, size_t smem, int block, int rows_per_block, auto stages, auto cluster) {
    constexpr int C = decltype(cluster)::value, STAGES = decltype(stages)::value;
    partials = C > 0 ? chunked_grid<STAGES>(kernel, block, smem, args.rows, rows_per_block, kChunkRows, C) / C
                     : persistent_grid<STAGES>(kernel, block, smem, args.rows, rows_per_block);
    return cudaSuccess;
  });
  return partials;
}

cudaError_t backward(const BackwardArgs& args, DType dtype, int partials, cudaStream_t stream) {
  return with_wide_variant(args, dtype, [&](auto kernel, size_t smem, int block, int, auto, auto cluster) {
    constexpr int C = decltype(cluster)::value;
    return tk::grid::launch_dependent_clustered(C > 0 ? C : 1, kernel, partials * (C > 0 ? C : 1), block, smem, stream,
                                                args);
  });
}

}  // namespace pipe_wide
}  // namespace tk_layernorm
