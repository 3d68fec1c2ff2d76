// Rotary embedding: the launch (the tile kernel, tile.cuh, or where it does not cover the shape the row kernel,
// rows.cuh) and the checks it shares with the binding.
#include <cstdint>

#include "pack.cuh"

namespace tk_rotary {

bool supported(DType in, DType tables, DType out) {
  Args a{};
  a.in = in, a.tables = tables, a.out = out;
  return with_dtypes(a, [](auto, auto, auto) { return cudaSuccess; }) == cudaSuccess;
}

bool vectorizable(const Args& a, int vec) {
  if (a.head_dim % vec || a.rotary_dim % vec) return false;
  if (!a.interleaved && (a.rotary_dim / 2) % vec) return false;
  const int64_t in = int64_t(vec) * dtype_bytes(a.in), tables = int64_t(vec) * dtype_bytes(a.tables),
                out = int64_t(vec) * dtype_bytes(a.out);
  for (int i = 0; i < a.count; ++i) {
    const Operand& o = a.ops[i];
    if (reinterpret_cast<uintptr_t>(o.in) % in || reinterpret_cast<uintptr_t>(o.out) % out) return false;
    if (reinterpret_cast<uintptr_t>(o.cos) % tables || reinterpret_cast<uintptr_t>(o.sin) % tables) return false;
    for (int d = 0; d < 3; ++d)
      if (o.in_stride[d] % vec || o.out_stride[d] % vec || o.cs_stride[d] % vec) return false;
  }
  return true;
}

cudaError_t launch(const Args& args, cudaStream_t stream) {
  if (args.count < 1 || args.count > 2 || args.rotary_dim <= 0 || args.rotary_dim % 2 || args.rotary_dim > args.head_dim)
    return cudaErrorInvalidValue;
  if (!supported(args.in, args.tables, args.out)) return cudaErrorInvalidValue;
  return with_x(args.in, [&](auto x) {
    using TI = typename decltype(x)::type;
    const cudaError_t err = launch_tile_x<TI>(args, stream);
    return err == cudaErrorNotSupported ? launch_rows_x<TI>(args, stream) : err;
  });
}

}  // namespace tk_rotary
