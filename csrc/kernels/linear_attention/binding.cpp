// Registers the Based kernels as the raw ops tk_cuda::linear_attention and tk_cuda::linear_attention_backward, with
// the schemas of the user-facing tk:: ops. tk_inductor/ops/linear_attention.py calls them only for what
// `kernel_supports` accepts (feature map "based", bf16, dk 16, dv a multiple of 64, no weights); the checks here
// guard direct calls.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "linear_attention.h"
#include "binding/operand.h"

namespace {

using at::Tensor;
namespace la = tk_linear_attention;

// The checks both ops share; `op` names the raw op in the messages.
void check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view feature_map,
                  const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight) {
  TORCH_CHECK(feature_map == "based", op, ": the kernel implements feature map 'based', not '",
              std::string(feature_map), "'");
  TORCH_CHECK(!(q_weight && q_weight->defined()) && !(k_weight && k_weight->defined()), op, ": 'based' takes no weights");
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), op, ": inputs must be CUDA tensors");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              op, ": q, k (B, H, N, 16) and v (B, H, N, dv) must agree");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              op, ": the kernel takes bfloat16");
  TORCH_CHECK(q.size(3) == la::BASED_DK, op, ": q/k feature dim must be ", la::BASED_DK);
  TORCH_CHECK(v.size(3) % la::BASED_DV_TILE == 0 && v.size(3) > 0, op, ": dv must be a positive multiple of ",
              la::BASED_DV_TILE);
  TORCH_CHECK(q.size(2) <= 0x7fffffff && q.size(0) * q.size(1) <= 0x7fffffff, op, ": too large");
}

template <class Args>
void set_inputs(Args& a, const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool normalize, double eps) {
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr();
  a.B = int(q.size(0)), a.H = int(q.size(1)), a.N = int(q.size(2)), a.dv = int(v.size(3));
  for (int d = 0; d < 3; ++d) a.q_stride[d] = q.stride(d), a.k_stride[d] = k.stride(d), a.v_stride[d] = v.stride(d);
  a.scale = float(scale), a.normalize = normalize, a.eps = float(eps);
}

Tensor linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view feature_map,
                        const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight, double scale,
                        bool normalize, double eps) {
  check_inputs("tk_cuda::linear_attention", q, k, v, feature_map, q_weight, k_weight);
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor o = at::empty(v.sizes(), v.options());
  if (o.numel() == 0) return o;
  const Tensor qq = binding::rows16(q), kk = binding::rows16(k), vv = binding::rows16(v);
  la::BasedArgs a{};
  set_inputs(a, qq, kk, vv, scale, normalize, eps);
  a.o = o.data_ptr();
  const char* err = la::launch_based(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, "tk_cuda::linear_attention: ", err ? err : "");
  return o;
}

// (dq, dk, dv, dq_weight, dk_weight), the weight gradients empty ('based' has none). o is the forward's output:
// the denominator's gradient needs do·o over whole rows, which a block of 64 value columns does not see.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> linear_attention_backward(
    const Tensor& grad_o, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
    c10::string_view feature_map, const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight,
    double scale, bool normalize, double eps) {
  const char* op = "tk_cuda::linear_attention_backward";
  check_inputs(op, q, k, v, feature_map, q_weight, k_weight);
  TORCH_CHECK(grad_o.sizes() == v.sizes() && o.sizes() == v.sizes() && grad_o.device() == q.device() &&
                  o.device() == q.device(), op,
              ": grad_o and o must have v's shape, on q's device");
  const c10::cuda::CUDAGuard guard(q.device());
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor dq = at::zeros(q.sizes(), f32), dk = at::zeros(k.sizes(), f32);  // value tiles add into them
  Tensor dv = at::empty(v.sizes(), v.options());
  // the absent weight gradients: two empty tensors (a custom op's outputs must not alias one another)
  const auto none = [&] { return at::empty({0}, q.options()); };
  if (v.numel() == 0) return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv, none(), none()};
  const Tensor qq = binding::rows16(q), kk = binding::rows16(k), vv = binding::rows16(v);
  const Tensor dout = grad_o.to(at::kBFloat16).contiguous();
  const Tensor ob = normalize ? o.to(at::kBFloat16).contiguous() : Tensor();  // only the delta kernel reads it
  Tensor delta = normalize ? at::empty({q.size(0), q.size(1), q.size(2)}, f32) : Tensor();  // the launch fills it
  Tensor inv = at::empty({q.size(0), q.size(1), q.size(2)}, f32);
  la::BasedBwdArgs a{};
  set_inputs(a, qq, kk, vv, scale, normalize, eps);
  a.dout = dout.data_ptr(), a.o = normalize ? ob.data_ptr() : nullptr;
  a.delta = normalize ? delta.data_ptr<float>() : nullptr;
  a.inv = inv.data_ptr<float>();
  a.dq = dq.data_ptr<float>(), a.dk = dk.data_ptr<float>(), a.dv_out = dv.data_ptr();
  const char* err = la::launch_based_backward(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, op, ": ", err ? err : "");
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv, none(), none()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("linear_attention(Tensor q, Tensor k, Tensor v, str feature_map, Tensor? q_weight=None, "
        "Tensor? k_weight=None, float scale=1.0, bool normalize=False, float eps=0.0) -> Tensor");
  m.def("linear_attention_backward(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, str feature_map, "
        "Tensor? q_weight, Tensor? k_weight, float scale, bool normalize, float eps) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("linear_attention", &linear_attention);
  m.impl("linear_attention_backward", &linear_attention_backward);
}
