// Backward: the dispatcher (the persistent kernel of backward_pipe.cuh instantiated per x dtype in
// backward_pipe_<x>[_lean].cu, or the register-only kernel of backward.cuh instantiated per x dtype and row length in
// backward_<x>_<rows>.cu and for gated rows in backward_gated_<rows>.cu) and the column sum of the dw/db partials.
#include "config.cuh"

namespace tk_layernorm {
namespace {

// out[c] = sum over blocks of partial[blocks][c], in a fixed order: 32 strided slices, then the slices in order.
template <typename T>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* partial, int blocks, int hidden, T* dw, T* db) {
  __shared__ float slices[32][33];
  tk::grid::wait_prior_grid();  // launch_dependent: the main kernel's partials
  T* out = blockIdx.y == 0 ? dw : db;
  if (!out) return;  // uniform per block
  const float* src = partial + int64_t(blockIdx.y) * blocks * hidden;
  const int col = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (col < hidden) {
    // Independent loads in flight: this kernel is pure latency. (Issuing all of a slice's loads, up to 16, before
    // the first add ran 1 us slower per call on the H200 at hidden 1024, 263 partial rows.)
#pragma unroll 8
    for (int k = threadIdx.y; k < blocks; k += 32) s += src[int64_t(k) * hidden + col];
  }
  slices[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    float total = 0.f;
#pragma unroll 8
    for (int j = 0; j < 32; ++j) total += slices[j][threadIdx.x];
    out[col] = from_float<T>(total);
  }
}

int registers_blocks(const BackwardArgs& args) {
  int blocks = 0;
  with_rows(args.hidden, [&](auto r) {
    if (args.gate) blocks = registers_blocks_x<float, true, r.value>(args);
    else
      with_x(args.dtypes.x, [&](auto x) {
        blocks = registers_blocks_x<decltype(x), false, r.value>(args);
        return cudaSuccess;
      });
    return cudaSuccess;
  });
  return blocks;
}

cudaError_t registers_backward(const BackwardArgs& args, int blocks, cudaStream_t stream) {
  return with_rows(args.hidden, [&](auto r) {
    if (args.gate) return registers_backward_x<float, true, r.value>(args, blocks, stream);
    return with_x(args.dtypes.x,
                  [&](auto x) { return registers_backward_x<decltype(x), false, r.value>(args, blocks, stream); });
  });
}

// The persistent kernels (backward_pipe.cuh) stage h in its one 16-bit dtype. The register-only kernel runs the
// rest: fp32 rows, faster there, gated calls (h recomputed from x and the gate, in fp32), and staging that does not
// fit in shared memory (blocks 0).
int pipe_blocks(const BackwardArgs& args) {
  int blocks = 0;
  if (args.gate) return blocks;
  with_x(args.dtypes.x, [&](auto x) {
    using X = decltype(x);
    if constexpr (!std::is_same_v<X, float>)
      blocks = pipe_lean(args.hidden) ? pipe_blocks_x<X, true>(args) : pipe_blocks_x<X, false>(args);
    return cudaSuccess;
  });
  return blocks;
}

cudaError_t pipe_backward(const BackwardArgs& args, int blocks, cudaStream_t stream) {
  return with_x(args.dtypes.x, [&](auto x) {
    using X = decltype(x);
    if constexpr (std::is_same_v<X, float>) return cudaErrorNotSupported;
    else if (pipe_lean(args.hidden)) return pipe_backward_x<X, true>(args, blocks, stream);
    else return pipe_backward_x<X, false>(args, blocks, stream);
  });
}

}  // namespace

int backward_blocks(const BackwardArgs& args) {
  const int blocks = pipe_blocks(args);
  return blocks > 0 ? blocks : registers_blocks(args);  // the persistent kernel does not fit: registers only
}

cudaError_t backward(const BackwardArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 8 || args.hidden > kMaxHidden || args.rows < 0) return cudaErrorInvalidValue;
  if (args.gate && (args.dh || args.dres || !args.dx || !args.dgate || args.dropout.enabled ||
                    args.dtypes.h != DType::f32))
    return cudaErrorInvalidValue;  // gated: no dh or dropout, h fp32 and its gradient not kept; dx and dgate written
  // The same choice as backward_blocks, which sized `partial`.
  const int piped = pipe_blocks(args);
  const int blocks = piped > 0 ? piped : registers_blocks(args);
  const cudaError_t err = piped > 0 ? pipe_backward(args, blocks, stream) : registers_backward(args, blocks, stream);
  if (err != cudaSuccess || (!args.dw && !args.db)) return err;
  return with_types(kernel_types(args.dtypes, args.gate), [&](auto ty) {
    using W = typename decltype(ty)::W;
    return tk::grid::launch_dependent(column_sum_kernel<W>, dim3((args.hidden + 31) / 32, 2), dim3(32, 32), 0, stream,
                                      static_cast<const float*>(args.partial), blocks, args.hidden,
                                      static_cast<W*>(args.dw), static_cast<W*>(args.db));
  });
}

}  // namespace tk_layernorm
