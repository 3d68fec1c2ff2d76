// Forward: the argument checks and the dispatch on x's dtype and the row length to forward_x (forward.cuh), instantiated
// once per (x, rows) in forward_<x>_<rows>.cu and for gated rows in forward_gated_<rows>.cu.
#include "config.cuh"

namespace tk_layernorm {

bool supported(DTypes t) {
  return with_types(t, [](auto) { return cudaSuccess; }) == cudaSuccess;
}

bool gate_supported(DType w, DType y) { return supported(DTypes{DType::f32, DType::f32, w, y}); }

cudaError_t forward(const ForwardArgs& args, cudaStream_t stream) {
  if (args.hidden <= 0 || args.hidden % 8 || args.hidden > kMaxHidden || args.rows < 0) return cudaErrorInvalidValue;
  if (args.rows == 0) return cudaSuccess;
  const bool gated = args.gate != nullptr;
  if (gated && (args.residual || args.h || args.dropout.enabled || args.dtypes.h != DType::f32))
    return cudaErrorInvalidValue;  // the gated norm has no residual or dropout, and h is fp32 and not stored
  return with_rows(args.hidden, [&](auto r) {
    if (gated) return forward_x<float, true, r.value>(args, stream);
    return with_x(args.dtypes.x, [&](auto x) { return forward_x<decltype(x), false, r.value>(args, stream); });
  });
}

}  // namespace tk_layernorm
