// Registers the rotary kernel as the raw op tk_cuda::rotary, with the schema of the user-facing tk::rotary
// (tk_inductor/ops/rotary.py validates inputs, broadcasts cos/sin and allocates nothing itself).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "rotary.h"
#include "tk/env.h"

namespace {

using at::Tensor;

tk_rotary::DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return tk_rotary::DType::f32;
    case at::kHalf: return tk_rotary::DType::f16;
    case at::kBFloat16: return tk_rotary::DType::bf16;
    default: TORCH_CHECK(false, "tk_cuda::rotary: unsupported dtype ", t.scalar_type());
  }
}

// Output layout: x's own (dense) layout, or contiguous when asked (what the replaced eager code produced).
Tensor make_output(const Tensor& x, bool contiguous) {
  return contiguous ? at::empty(x.sizes(), x.options()) : at::empty_like(x);
}

tk_rotary::Operand operand(const Tensor& x, const Tensor& out, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 4, "tk_cuda::rotary: inputs must have 1 to 4 dimensions");
  TORCH_CHECK(x.stride(-1) == 1 && out.stride(-1) == 1, "tk_cuda::rotary: the head dimension must have unit stride");
  TORCH_CHECK(cos.dim() == x.dim() && sin.dim() == x.dim(), "tk_cuda::rotary: cos/sin must have the rank of the input");
  const auto rd = cos.size(-1);
  // Broadcast cos/sin over the input's leading dims (stride 0 where they have size 1).
  const Tensor c = cos.expand([&] { auto s = x.sizes().vec(); s.back() = rd; return s; }());
  const Tensor s = sin.expand(c.sizes());
  TORCH_CHECK(c.strides() == s.strides() && c.stride(-1) == 1, "tk_cuda::rotary: cos and sin must share strides with a unit last stride");
  tk_rotary::Operand o{};
  o.out = out.data_ptr();
  o.in = x.data_ptr();
  o.cos = c.data_ptr();
  o.sin = s.data_ptr();
  const int lead = 4 - x.dim();  // left-pad to (B, H, N, D)
  for (int d = 0; d < 3; ++d) {
    const int src = d - lead;
    o.shape[d] = src >= 0 ? x.size(src) : 1;
    o.in_stride[d] = src >= 0 ? x.stride(src) : 0;
    o.out_stride[d] = src >= 0 ? out.stride(src) : 0;
    o.cs_stride[d] = src >= 0 ? c.stride(src) : 0;
  }
  return o;
}

std::tuple<Tensor, Tensor> rotary_variant(const Tensor& q, const std::optional<Tensor>& k, const Tensor& cos, const Tensor& sin,
                                          bool interleaved, bool backward, bool contiguous, int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant < tk_rotary::kVariantCount, "tk_cuda::rotary_variant: variant must be in [0, ", tk_rotary::kVariantCount, ")");
  TORCH_CHECK(q.is_cuda() && cos.is_cuda() && sin.is_cuda(), "tk_cuda::rotary: inputs must be CUDA tensors");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type(), "tk_cuda::rotary: cos/sin dtype must match q");
  const bool has_k = k && k->defined();
  if (has_k) TORCH_CHECK(k->is_cuda() && k->scalar_type() == q.scalar_type() && k->size(-1) == q.size(-1), "tk_cuda::rotary: k must match q");
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor qo = make_output(q, contiguous);
  Tensor ko = has_k ? make_output(*k, contiguous) : at::empty({0}, q.options());
  tk_rotary::Args a{};
  a.ops[0] = operand(q, qo, cos, sin);
  if (has_k) a.ops[1] = operand(*k, ko, cos, sin);
  a.count = has_k ? 2 : 1;
  a.head_dim = static_cast<int>(q.size(-1));
  a.rotary_dim = static_cast<int>(cos.size(-1));
  a.interleaved = interleaved;
  a.backward = backward;
  const cudaError_t err = tk_rotary::launch(a, dtype_of(q), c10::cuda::getCurrentCUDAStream(), static_cast<int>(variant));
  TORCH_CHECK(err == cudaSuccess, "tk_cuda::rotary: launch failed: ", cudaGetErrorString(err));
  return {qo, ko};
}

// The variant tk_cuda::rotary runs: kDefaultVariant, or TK_ROTARY_VARIANT (read once) to undo a default
// that measures worse without a rebuild.
int64_t default_variant() {
  static const int64_t v = [] {
    int parsed = tk_rotary::kDefaultVariant;
    TORCH_CHECK(tk::env_variant("TK_ROTARY_VARIANT", tk_rotary::kVariantCount, parsed),
                "TK_ROTARY_VARIANT must be an integer in [0, ", tk_rotary::kVariantCount, "), got '",
                std::getenv("TK_ROTARY_VARIANT"), "'");
    return int64_t(parsed);
  }();
  return v;
}

std::tuple<Tensor, Tensor> rotary(const Tensor& q, const std::optional<Tensor>& k, const Tensor& cos, const Tensor& sin,
                                  bool interleaved, bool backward, bool contiguous) {
  return rotary_variant(q, k, cos, sin, interleaved, backward, contiguous, default_variant());
}

// Variant names by index, for benchmarks and tests.
std::vector<std::string> rotary_variants() {
  std::vector<std::string> names;
  for (const auto& v : tk_rotary::kVariants) names.emplace_back(v.name);
  return names;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("rotary(Tensor q, Tensor? k, Tensor cos, Tensor sin, bool interleaved, bool backward, bool contiguous) -> (Tensor, Tensor)");
  // The same with an explicit kernel variant (index into rotary_variants()).
  m.def("rotary_variant(Tensor q, Tensor? k, Tensor cos, Tensor sin, bool interleaved, bool backward, bool contiguous, int variant) -> (Tensor, Tensor)");
  m.def("rotary_variants() -> str[]", &rotary_variants);
  m.def("rotary_default_variant() -> int", &default_variant);
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("rotary", &rotary);
  m.impl("rotary_variant", &rotary_variant);
}
