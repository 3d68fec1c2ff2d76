// Registers the rotary kernel as the raw op tk_cuda::rotary, with the schema of the user-facing tk::rotary
// (tk_inductor/ops/rotary.py validates inputs, broadcasts cos/sin and allocates nothing itself).
#include "binding/stable.h"

#include <optional>
#include <tuple>

#include "rotary.h"

namespace {

using binding::dtype_name;
using binding::OptTensor;
using binding::ScalarType;
using binding::Sizes;
using binding::Tensor;

tk_rotary::DType dtype_of(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return tk_rotary::DType::f32;
    case ScalarType::Half: return tk_rotary::DType::f16;
    case ScalarType::BFloat16: return tk_rotary::DType::bf16;
    default: STD_TORCH_CHECK(false, "tk_cuda::rotary: unsupported dtype ", dtype_name(t));
  }
  return tk_rotary::DType::f32;
}

// Output layout: x's own (dense) layout, or contiguous when asked (what the replaced eager code produced).
Tensor make_output(const Tensor& x, bool contiguous, ScalarType dtype) {
  return contiguous ? torch::stable::new_empty(x, x.sizes(), dtype) : binding::empty_like(x, dtype);
}

// The strides of t broadcast to x's sizes with t's last size: 0 along t's unit dims (t has x's rank).
Sizes broadcast_strides(const Tensor& t, const Tensor& x) {
  Sizes st(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    const bool last = d + 1 == t.dim();
    STD_TORCH_CHECK(last || t.size(d) == x.size(d) || t.size(d) == 1,
                    "tk_cuda::rotary: cos/sin do not broadcast to the input");
    st[d] = !last && t.size(d) == 1 && x.size(d) != 1 ? 0 : t.stride(d);
  }
  return st;
}

tk_rotary::Operand operand(const Tensor& x, const Tensor& out, const Tensor& cos, const Tensor& sin) {
  STD_TORCH_CHECK(x.dim() >= 1 && x.dim() <= 4, "tk_cuda::rotary: inputs must have 1 to 4 dimensions");
  STD_TORCH_CHECK(x.stride(-1) == 1 && out.stride(-1) == 1, "tk_cuda::rotary: the head dimension must have unit stride");
  STD_TORCH_CHECK(cos.dim() == x.dim() && sin.dim() == x.dim(), "tk_cuda::rotary: cos/sin must have the rank of the input");
  // Broadcast cos/sin over the input's leading dims (stride 0 where they have size 1).
  const Sizes cst = broadcast_strides(cos, x);
  STD_TORCH_CHECK(cst == broadcast_strides(sin, x) && cst.back() == 1,
                  "tk_cuda::rotary: cos and sin must share strides with a unit last stride");
  tk_rotary::Operand o{};
  o.out = out.data_ptr();
  o.in = x.data_ptr();
  o.cos = cos.data_ptr();
  o.sin = sin.data_ptr();
  const int lead = 4 - x.dim();  // left-pad to (B, H, N, D)
  for (int d = 0; d < 3; ++d) {
    const int src = d - lead;
    o.shape[d] = src >= 0 ? x.size(src) : 1;
    o.in_stride[d] = src >= 0 ? x.stride(src) : 0;
    o.out_stride[d] = src >= 0 ? out.stride(src) : 0;
    o.cs_stride[d] = src >= 0 ? cst[src] : 0;
  }
  return o;
}

// y's dtype: out_dtype, or what eager's x * cos + rot(x) * sin gives (x's and the tables' dtypes promoted).
// cos/sin of a lower rank than q are padded with leading unit dims (a view); the kernel indexes both tables with
// one set of strides and a unit last stride, so tables that differ there are copied (they are small).
std::tuple<Tensor, Tensor> tables(const Tensor& q, const Tensor& cos, const Tensor& sin) {
  STD_TORCH_CHECK(cos.dim() <= q.dim() && binding::same_sizes(cos, sin),
                  "tk_cuda::rotary: cos and sin must have one shape, of at most q's rank");
  auto padded = [&](const Tensor& t) {
    Sizes sizes(q.dim() - t.dim(), 1);
    for (int64_t d = 0; d < t.dim(); ++d) sizes.push_back(t.size(d));
    return torch::stable::reshape(t, sizes);
  };
  Tensor c = padded(cos), s = padded(sin);
  bool same = c.stride(-1) == 1 && s.stride(-1) == 1;
  for (int64_t d = 0; d < c.dim(); ++d) same = same && c.stride(d) == s.stride(d);
  if (!same) c = torch::stable::contiguous(c), s = torch::stable::contiguous(s);
  return {c, s};
}

std::tuple<Tensor, Tensor> rotary(const Tensor& q, const OptTensor& k, const Tensor& cos_in, const Tensor& sin_in,
                                  bool interleaved, bool backward, bool contiguous,
                                  std::optional<ScalarType> out_dtype) {
  STD_TORCH_CHECK(q.is_cuda() && cos_in.is_cuda() && sin_in.is_cuda(), "tk_cuda::rotary: inputs must be CUDA tensors");
  STD_TORCH_CHECK(sin_in.scalar_type() == cos_in.scalar_type(), "tk_cuda::rotary: cos and sin must have one dtype");
  const auto [cos, sin] = tables(q, cos_in, sin_in);
  const ScalarType out_type = out_dtype.value_or(binding::promote_floats(q.scalar_type(), cos.scalar_type()));
  const bool has_k = binding::present(k);
  if (has_k) STD_TORCH_CHECK(k->is_cuda() && k->scalar_type() == q.scalar_type() && k->size(-1) == q.size(-1), "tk_cuda::rotary: k must match q");
  tk_rotary::Args a{};
  a.in = dtype_of(q.scalar_type());
  a.tables = dtype_of(cos.scalar_type());
  a.out = dtype_of(out_type);
  STD_TORCH_CHECK(tk_rotary::supported(a.in, a.tables, a.out), "tk_cuda::rotary: no kernel for x ",
                  dtype_name(q.scalar_type()), ", cos/sin ", dtype_name(cos.scalar_type()), ", output ",
                  dtype_name(out_type));
  const binding::DeviceGuard guard(q.get_device_index());
  Tensor qo = make_output(q, contiguous, out_type);
  Tensor ko = has_k ? make_output(*k, contiguous, out_type) : torch::stable::new_empty(q, Sizes{0}, out_type);
  a.ops[0] = operand(q, qo, cos, sin);
  if (has_k) a.ops[1] = operand(*k, ko, cos, sin);
  a.count = has_k ? 2 : 1;
  a.head_dim = static_cast<int>(q.size(-1));
  a.rotary_dim = static_cast<int>(cos.size(-1));
  a.interleaved = interleaved;
  a.backward = backward;
  const cudaError_t err = tk_rotary::launch(a, binding::current_stream(q));
  STD_TORCH_CHECK(err == cudaSuccess, "tk_cuda::rotary: launch failed: ", cudaGetErrorString(err));
  return {qo, ko};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("rotary(Tensor q, Tensor? k, Tensor cos, Tensor sin, bool interleaved, bool backward, bool contiguous, "
        "ScalarType? out_dtype=None) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("rotary", TORCH_BOX(&rotary));
}
