// Registers the rotary kernel as the raw op tk_cuda::rotary, with the schema of the user-facing tk::rotary
// (tk_inductor/ops/rotary.py validates inputs, broadcasts cos/sin and allocates nothing itself).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "rotary.h"

namespace {

using at::Tensor;

tk_rotary::DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return tk_rotary::DType::f32;
    case at::kHalf: return tk_rotary::DType::f16;
    case at::kBFloat16: return tk_rotary::DType::bf16;
    default: TORCH_CHECK(false, "tk_cuda::rotary: unsupported dtype ", t);
  }
}

// Output layout: x's own (dense) layout, or contiguous when asked (what the replaced eager code produced).
Tensor make_output(const Tensor& x, bool contiguous, at::ScalarType dtype) {
  const auto options = x.options().dtype(dtype);
  return contiguous ? at::empty(x.sizes(), options) : at::empty_like(x, options);
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

// y's dtype: out_dtype, or what eager's x * cos + rot(x) * sin gives (x's and the tables' dtypes promoted).
// cos/sin of a lower rank than q are padded with leading unit dims (a view); the kernel indexes both tables with
// one set of strides and a unit last stride, so tables that differ there are copied (they are small).
std::tuple<Tensor, Tensor> tables(const Tensor& q, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK(cos.dim() <= q.dim() && cos.sizes() == sin.sizes(), "tk_cuda::rotary: cos and sin must have one shape, of at most q's rank");
  auto padded = [&](const Tensor& t) {
    auto sizes = t.sizes().vec();
    sizes.insert(sizes.begin(), q.dim() - t.dim(), 1);
    return t.reshape(sizes);
  };
  Tensor c = padded(cos), s = padded(sin);
  if (c.strides() != s.strides() || c.stride(-1) != 1) c = c.contiguous(), s = s.contiguous();
  return {c, s};
}

std::tuple<Tensor, Tensor> rotary(const Tensor& q, const std::optional<Tensor>& k, const Tensor& cos_in,
                                  const Tensor& sin_in, bool interleaved, bool backward, bool contiguous,
                                  std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(q.is_cuda() && cos_in.is_cuda() && sin_in.is_cuda(), "tk_cuda::rotary: inputs must be CUDA tensors");
  TORCH_CHECK(sin_in.scalar_type() == cos_in.scalar_type(), "tk_cuda::rotary: cos and sin must have one dtype");
  const auto [cos, sin] = tables(q, cos_in, sin_in);
  const at::ScalarType out_type = out_dtype.value_or(c10::promoteTypes(q.scalar_type(), cos.scalar_type()));
  const bool has_k = k && k->defined();
  if (has_k) TORCH_CHECK(k->is_cuda() && k->scalar_type() == q.scalar_type() && k->size(-1) == q.size(-1), "tk_cuda::rotary: k must match q");
  tk_rotary::Args a{};
  a.in = dtype_of(q.scalar_type());
  a.tables = dtype_of(cos.scalar_type());
  a.out = dtype_of(out_type);
  TORCH_CHECK(tk_rotary::supported(a.in, a.tables, a.out), "tk_cuda::rotary: no kernel for x ", q.scalar_type(),
              ", cos/sin ", cos.scalar_type(), ", output ", out_type);
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor qo = make_output(q, contiguous, out_type);
  Tensor ko = has_k ? make_output(*k, contiguous, out_type) : at::empty({0}, q.options().dtype(out_type));
  a.ops[0] = operand(q, qo, cos, sin);
  if (has_k) a.ops[1] = operand(*k, ko, cos, sin);
  a.count = has_k ? 2 : 1;
  a.head_dim = static_cast<int>(q.size(-1));
  a.rotary_dim = static_cast<int>(cos.size(-1));
  a.interleaved = interleaved;
  a.backward = backward;
  const cudaError_t err = tk_rotary::launch(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "tk_cuda::rotary: launch failed: ", cudaGetErrorString(err));
  return {qo, ko};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("rotary(Tensor q, Tensor? k, Tensor cos, Tensor sin, bool interleaved, bool backward, bool contiguous, "
        "ScalarType? out_dtype=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("rotary", &rotary);
}
