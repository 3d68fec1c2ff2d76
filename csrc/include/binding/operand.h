#pragma once
// Host side of the bindings, on torch tensors (the tile library under tk/ is device code and torch-free): operands in
// a form the kernels' 16-byte loads (vectors, cp.async, TMA) can read. Any tensor a user can pass is accepted; one
// the kernels cannot read in place is copied once.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace binding {

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// t row-major on a 16-byte aligned base: t itself when it already is, else a copy. (`contiguous()` alone keeps a
// contiguous view at an unaligned storage offset, such as `flat[1:]`, where a 16-byte load faults.)
inline at::Tensor dense(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

// t with its own strides when every row starts 16-byte aligned (unit last stride, aligned base, the other strides
// whole 16-byte multiples or their sizes 1), else dense(t): layouts such as (B, N, H, D) seen as (B, H, N, D) are
// read in place.
inline at::Tensor rows16(const at::Tensor& t) {
  const int64_t per16 = 16 / int64_t(t.element_size());
  bool ok = t.dim() > 0 && t.stride(-1) == 1 && aligned16(t);
  for (int64_t d = 0; d + 1 < t.dim() && ok; ++d) ok = t.size(d) == 1 || t.stride(d) % per16 == 0;
  return ok ? t : dense(t);
}

}  // namespace binding
