// Backward, persistent "pipe" variants 1..3 and the dispatcher of all pipe variants; the kernel is in
// backward_pipe.cuh, variants 4..11 in backward_pipe_wide.cu.
#include "backward_pipe.cuh"

namespace tk_layernorm {
namespace {

// f(kernel, smem bytes, block, rows per block, stages) for the variant's instantiation.
template <typename F>
cudaError_t with_variant(const BackwardArgs& args, DType dtype, F&& f) {
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    switch (args.variant) {
      case 1: return with_pipe_split<true, 1>(args.hidden, [&](auto s) { return pick<T, decltype(s), 3, 1024, false>(args, f); });
      case 2: return with_pipe_split<true, 1>(args.hidden, [&](auto s) { return pick<T, decltype(s), 3, 768, false>(args, f); });
      case 3: return with_pipe_split<true, 2>(args.hidden, [&](auto s) { return pick<T, decltype(s), 3, 512, false>(args, f); });
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace

namespace pipe {

int backward_blocks(const BackwardArgs& args, DType dtype) {
  BackwardArgs a = args;
  a.variant = effective_variant(args);
  if (a.variant >= 4) return pipe_wide::backward_blocks(a, dtype);
  int blocks = 0;
  with_variant(a, dtype, [&](auto kernel, size_t smem, int block, int rows_per_block, auto stages) {
    blocks = persistent_grid<decltype(stages)::value>(kernel, block, smem, a.rows, rows_per_block);
    return cudaSuccess;
  });
  return blocks;
}

cudaError_t backward(const BackwardArgs& args, DType dtype, int blocks, cudaStream_t stream) {
  BackwardArgs a = args;
  a.variant = effective_variant(args);
  if (a.variant >= 4) return pipe_wide::backward(a, dtype, blocks, stream);
  return with_variant(a, dtype, [&](auto kernel, size_t smem, int block, int, auto) {
    return tk::grid::launch_dependent(kernel, blocks, block, smem, stream, a);
  });
}

}  // namespace pipe
}  // namespace tk_layernorm
