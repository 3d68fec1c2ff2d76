// The helpers of the two bindings, binding_forward.cpp and binding_backward.cpp (one file per op, so that the build
// compiles them in parallel): they register the layernorm kernels as raw ops tk_cuda::layernorm and
// tk_cuda::layernorm_backward, with the schemas of the user-facing tk:: ops (tk_inductor/ops/layernorm.py validates
// inputs before calling here).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "layernorm.h"
#include "binding/operand.h"

namespace tk_layernorm_binding {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

inline tk_layernorm::DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return tk_layernorm::DType::f32;
    case at::kHalf: return tk_layernorm::DType::f16;
    case at::kBFloat16: return tk_layernorm::DType::bf16;
    default: TORCH_CHECK(false, "tk_cuda::layernorm: unsupported dtype ", t);
  }
}

inline const void* ptr_or_null(const OptTensor& t) { return t && t->defined() ? t->data_ptr() : nullptr; }
inline bool present(const OptTensor& t) { return t && t->defined(); }
// The kernels read row-major operands on 16-byte aligned bases: any other is copied (binding/operand.h).
inline OptTensor contig(const OptTensor& t) { return present(t) ? OptTensor(binding::dense(*t)) : t; }

inline void check_operand(const OptTensor& t, const Tensor& x, int64_t numel, const char* name) {
  if (!present(t)) return;
  TORCH_CHECK(t->is_cuda() && t->device() == x.device(), "tk_cuda::layernorm: ", name, " must be on ", x.device());
  TORCH_CHECK(t->is_contiguous() && t->numel() == numel, "tk_cuda::layernorm: ", name, " must be contiguous with ", numel, " elements");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "tk_cuda::layernorm: ", name, " must be 16-byte aligned");
}

// The call's dtypes (layernorm.h DTypes). Without a weight or bias their dtype is free: the output's where the
// kernels take that combination, fp32 otherwise.
inline tk_layernorm::DTypes dtypes_of(at::ScalarType x, at::ScalarType h, std::optional<at::ScalarType> w,
                                     at::ScalarType y) {
  tk_layernorm::DTypes t{dtype_of(x), dtype_of(h), dtype_of(w.value_or(y)), dtype_of(y)};
  if (!w && !tk_layernorm::supported(t)) t.w = tk_layernorm::DType::f32;
  TORCH_CHECK(tk_layernorm::supported(t), "tk_cuda::layernorm: no kernel for x ", x, ", residual/h ", h, ", weight ",
              w ? c10::toString(*w) : "(none)", ", output ", y);
  return t;
}

// A gated call's dtypes: h is fp32, x any; the kernels are those of (fp32, fp32, w, y) (layernorm.h gate_supported).
inline tk_layernorm::DTypes gated_dtypes(at::ScalarType x, std::optional<at::ScalarType> w, at::ScalarType y) {
  tk_layernorm::DTypes t{dtype_of(x), tk_layernorm::DType::f32, dtype_of(w.value_or(y)), dtype_of(y)};
  if (!w && !tk_layernorm::gate_supported(t.w, t.y)) t.w = tk_layernorm::DType::f32;
  TORCH_CHECK(tk_layernorm::gate_supported(t.w, t.y), "tk_cuda::layernorm: no gated kernel for weight ",
              w ? c10::toString(*w) : "(none)", ", output ", y);
  return t;
}

inline std::optional<at::ScalarType> weight_dtype(const OptTensor& weight, const OptTensor& bias) {
  if (present(weight) && present(bias))
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(), "tk_cuda::layernorm: weight and bias must have one dtype");
  if (present(weight)) return weight->scalar_type();
  if (present(bias)) return bias->scalar_type();
  return std::nullopt;
}

inline tk_layernorm::DropoutArgs dropout_args(double p, const OptTensor& rng) {
  tk_layernorm::DropoutArgs d;
  if (p <= 0.0) return d;
  TORCH_CHECK(p < 1.0, "tk_cuda::layernorm: dropout p must be < 1");
  TORCH_CHECK(rng && rng->defined() && rng->device().is_cpu() && rng->scalar_type() == at::kLong && rng->numel() == 2,
              "tk_cuda::layernorm: dropout needs rng = CPU int64 tensor (seed, offset)");
  const Tensor r = rng->contiguous();
  const int64_t* v = r.data_ptr<int64_t>();
  d.enabled = true;
  d.seed = static_cast<uint64_t>(v[0]);
  d.offset = static_cast<uint64_t>(v[1]);
  // Same expression as tk_inductor/ops/philox.py: threshold(p) and dropout_scale(p).
  const double t = std::floor(p * 4294967296.0);
  d.threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
  d.scale = static_cast<float>(1.0 / (1.0 - p));
  return d;
}

}  // namespace tk_layernorm_binding
