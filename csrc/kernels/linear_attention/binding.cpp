// Registers the Based and plain kernels as the raw ops tk_cuda::linear_attention and
// tk_cuda::linear_attention_backward, with the schemas of the user-facing tk:: ops. tk_inductor/ops/linear_attention.py
// calls them only for what `kernel_supports` accepts (feature map "based" with dk 16, "identity" or "elu1" with dk 64
// or 128, "hedgehog" (forward only) with dk 64 or 128 and 32 or 64 projections; bf16, dv a multiple of 64); the
// checks here guard direct calls.
#include "binding/stable.h"

#include <optional>
#include <string>

#include "linear_attention.h"

namespace {

using binding::data;
using binding::OptTensor;
using binding::present;
using binding::ScalarType;
using binding::Sizes;
using binding::Tensor;
namespace la = tk_linear_attention;

// The plain kernels' feature map for `feature_map`, or none for "based".
std::optional<la::FeatureMap> plain_map(const std::string& feature_map) {
  if (feature_map == "identity") return la::FeatureMap::identity;
  if (feature_map == "elu1") return la::FeatureMap::elu1;
  if (feature_map == "hedgehog") return la::FeatureMap::hedgehog;
  return std::nullopt;
}

// Whether w is a Hedgehog weight for (B, H, N, dk) x: (H, dk, f) or (dk, f), with 2f features the kernels take.
bool hedgehog_weight(const Tensor& w, const Tensor& x) {
  const int64_t d = w.dim();
  if (x.dim() != 4 || (d != 2 && !(d == 3 && w.size(0) == x.size(1))) || w.size(d - 2) != x.size(3)) return false;
  const int64_t features = 2 * w.size(d - 1);
  return features == la::PLAIN_DK[0] || features == la::PLAIN_DK[1];
}

// The checks both ops share; `op` names the raw op in the messages.
void check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const std::string& feature_map,
                  const OptTensor& q_weight, const OptTensor& k_weight) {
  const bool plain = plain_map(feature_map).has_value(), hedgehog = feature_map == "hedgehog";
  STD_TORCH_CHECK(plain || feature_map == "based", op, ": the kernels implement feature maps 'based', 'identity', "
                  "'elu1' and 'hedgehog', not '", feature_map, "'");
  if (hedgehog) {
    STD_TORCH_CHECK(present(q_weight) && present(k_weight), op, ": 'hedgehog' needs q_weight and k_weight");
    STD_TORCH_CHECK(hedgehog_weight(*q_weight, q) && binding::same_sizes(*k_weight, *q_weight),
                    op, ": q_weight and k_weight must both be (H, dk, f) or (dk, f) with f 32 or 64");
    STD_TORCH_CHECK(binding::same_device(*q_weight, q) && binding::same_device(*k_weight, q), op,
                    ": the weights must be on q's device");
  } else {
    STD_TORCH_CHECK(!present(q_weight) && !present(k_weight), op, ": '", feature_map, "' takes no weights");
  }
  STD_TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), op, ": inputs must be CUDA tensors");
  STD_TORCH_CHECK(q.dim() == 4 && binding::same_sizes(k, q) && v.dim() == 4 && v.size(0) == q.size(0) &&
                      v.size(1) == q.size(1) && v.size(2) == q.size(2),
                  op, ": q, k (B, H, N, dk) and v (B, H, N, dv) must agree");
  const ScalarType bf16 = ScalarType::BFloat16;
  STD_TORCH_CHECK(q.scalar_type() == bf16 && k.scalar_type() == bf16 && v.scalar_type() == bf16, op,
                  ": the kernel takes bfloat16");
  if (plain) {
    STD_TORCH_CHECK(q.size(3) == la::PLAIN_DK[0] || q.size(3) == la::PLAIN_DK[1], op, ": q/k feature dim must be ",
                    la::PLAIN_DK[0], " or ", la::PLAIN_DK[1], " for '", feature_map, "'");
  } else {
    STD_TORCH_CHECK(q.size(3) == la::BASED_DK, op, ": q/k feature dim must be ", la::BASED_DK, " for 'based'");
  }
  STD_TORCH_CHECK(v.size(3) % la::VALUE_TILE == 0 && v.size(3) > 0, op, ": dv must be a positive multiple of ",
              la::VALUE_TILE);
  STD_TORCH_CHECK(q.size(2) <= 0x7fffffff && q.size(0) * q.size(1) <= 0x7fffffff, op, ": too large");
}

// Hedgehog's W (heads, dk, f) or (dk, f) as the kernels read it: Wᵀ in bf16, (heads, f, dk) contiguous.
Tensor weight_t(const Tensor& w) {
  const int64_t d = w.dim();
  return torch::stable::contiguous(binding::to(torch::stable::transpose(w, d - 2, d - 1), ScalarType::BFloat16));
}

template <class Args>
void set_inputs(Args& a, const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool normalize, double eps) {
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr();
  a.B = int(q.size(0)), a.H = int(q.size(1)), a.N = int(q.size(2)), a.dv = int(v.size(3));
  for (int d = 0; d < 3; ++d) a.q_stride[d] = q.stride(d), a.k_stride[d] = k.stride(d), a.v_stride[d] = v.stride(d);
  a.scale = float(scale), a.normalize = normalize, a.eps = float(eps);
}

Tensor linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::string& feature_map,
                        const OptTensor& q_weight, const OptTensor& k_weight, double scale,
                        bool normalize, double eps) {
  check_inputs("tk_cuda::linear_attention", q, k, v, feature_map, q_weight, k_weight);
  const binding::DeviceGuard guard(q.get_device_index());
  Tensor o = torch::stable::new_empty(v, v.sizes());
  if (o.numel() == 0) return o;
  const Tensor qq = binding::rows16(q), kk = binding::rows16(k), vv = binding::rows16(v);
  la::PlainArgs a{};
  set_inputs(a, qq, kk, vv, scale, normalize, eps);
  a.o = o.data_ptr();
  const std::optional<la::FeatureMap> map = plain_map(feature_map);
  a.features = a.dk = int(q.size(3)), a.map = map.value_or(la::FeatureMap::identity);
  const char* err = nullptr;
  if (a.map == la::FeatureMap::hedgehog) {
    const Tensor wq = weight_t(*q_weight), wk = weight_t(*k_weight);
    a.features = int(2 * wq.size(wq.dim() - 2)), a.weight_heads = wq.dim() == 3 ? int(wq.size(0)) : 1;
    a.q_weight_t = wq.data_ptr(), a.k_weight_t = wk.data_ptr();
    err = la::launch_hedgehog(a, binding::current_stream(q));
  } else {
    err = map ? la::launch_plain(a, binding::current_stream(q)) : la::launch_based(a, binding::current_stream(q));
  }
  STD_TORCH_CHECK(err == nullptr, "tk_cuda::linear_attention: ", err ? err : "");
  return o;
}

// (dq, dk, dv, dq_weight, dk_weight), the weight gradients empty (these feature maps have none). o is the forward's output:
// the denominator's gradient needs do·o over whole rows, which a block of 64 value columns does not see.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> linear_attention_backward(
    const Tensor& grad_o, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
    const std::string& feature_map, const OptTensor& q_weight, const OptTensor& k_weight,
    double scale, bool normalize, double eps) {
  const char* op = "tk_cuda::linear_attention_backward";
  check_inputs(op, q, k, v, feature_map, q_weight, k_weight);
  STD_TORCH_CHECK(feature_map != "hedgehog", op, ": no Hedgehog kernel (tk::linear_attention_backward differentiates "
                  "its feature map around the 'identity' kernel)");
  STD_TORCH_CHECK(binding::same_sizes(grad_o, v) && binding::same_sizes(o, v) && binding::same_device(grad_o, q) &&
                      binding::same_device(o, q),
                  op, ": grad_o and o must have v's shape, on q's device");
  const binding::DeviceGuard guard(q.get_device_index());
  const ScalarType f32 = ScalarType::Float;
  const std::optional<la::FeatureMap> map = plain_map(feature_map);
  // dq and dk: fp32 sums that the value tiles add into, or (plain, one value tile) the bf16 results themselves
  const bool direct = map && v.size(3) == la::VALUE_TILE;
  Tensor dq = direct ? torch::stable::new_empty(q, q.sizes()) : torch::stable::new_zeros(q, q.sizes(), f32);
  Tensor dk = direct ? torch::stable::new_empty(k, k.sizes()) : torch::stable::new_zeros(k, k.sizes(), f32);
  Tensor dv = torch::stable::new_empty(v, v.sizes());
  // the absent weight gradients: two empty tensors (a custom op's outputs must not alias one another)
  const auto none = [&] { return torch::stable::new_empty(q, Sizes{0}); };
  if (v.numel() == 0) {
    if (direct) dq = torch::stable::zero_(dq), dk = torch::stable::zero_(dk);
    return {binding::to(dq, q.scalar_type()), binding::to(dk, k.scalar_type()), dv, none(), none()};
  }
  const Tensor qq = binding::rows16(q), kk = binding::rows16(k), vv = binding::rows16(v);
  const Tensor dout = torch::stable::contiguous(binding::to(grad_o, ScalarType::BFloat16));
  // only the delta kernel reads o; the launch fills delta
  const Tensor ob = torch::stable::contiguous(binding::to(normalize ? o : none(), ScalarType::BFloat16));
  const Sizes rows{q.size(0), q.size(1), q.size(2)};
  Tensor delta = torch::stable::new_empty(q, normalize ? rows : Sizes{0}, f32);
  // the plain scans' Σ φk per chunk of 64 rows
  const Sizes chunk_sums{q.size(0), q.size(1), (q.size(2) + 63) / 64, q.size(3)};
  Tensor ksum = torch::stable::new_empty(q, normalize && map ? chunk_sums : Sizes{0}, f32);
  la::PlainBwdArgs a{};
  set_inputs(a, qq, kk, vv, scale, normalize, eps);
  a.dout = dout.data_ptr(), a.o = normalize ? ob.data_ptr() : nullptr;
  a.delta = normalize ? data<float>(delta) : nullptr;
  a.dv_out = dv.data_ptr();
  if (direct) a.dq_out = dq.data_ptr(), a.dk_out = dk.data_ptr();
  else a.dq = data<float>(dq), a.dk = data<float>(dk);
  a.features = int(q.size(3)), a.map = map.value_or(la::FeatureMap::identity);
  a.ksum = normalize && map ? data<float>(ksum) : nullptr;
  const char* err = map ? la::launch_plain_backward(a, binding::current_stream(q))
                        : la::launch_based_backward(a, binding::current_stream(q));
  STD_TORCH_CHECK(err == nullptr, op, ": ", err ? err : "");
  return {binding::to(dq, q.scalar_type()), binding::to(dk, k.scalar_type()), dv, none(), none()};
}

// Hedgehog's map on its own (the backward's): φ of x (B, H, N, dk) bf16 with weight (H, dk, f) or (dk, f); with
// grad_features, (dx, dz), dz the gradient of x W.
la::HedgehogMapArgs map_args(const char* op, const Tensor& x, const Tensor& weight) {
  STD_TORCH_CHECK(x.is_cuda() && binding::same_device(weight, x), op, ": x and weight must be on one CUDA device");
  STD_TORCH_CHECK(x.dim() == 4 && x.scalar_type() == ScalarType::BFloat16 &&
                      (x.size(3) == la::PLAIN_DK[0] || x.size(3) == la::PLAIN_DK[1]),
                  op, ": x must be (B, H, N, dk) bfloat16 with dk 64 or 128");
  STD_TORCH_CHECK(hedgehog_weight(weight, x), op, ": weight must be (H, dk, f) or (dk, f) with f 32 or 64");
  STD_TORCH_CHECK(x.size(2) <= 0x7fffffff && x.size(0) * x.size(1) <= 0x7fffffff, op, ": too large");
  la::HedgehogMapArgs a{};
  a.B = int(x.size(0)), a.H = int(x.size(1)), a.N = int(x.size(2)), a.dk = int(x.size(3));
  a.F = int(2 * weight.size(weight.dim() - 1)), a.weight_heads = weight.dim() == 3 ? a.H : 1;
  return a;
}

Tensor hedgehog_features(const Tensor& x, const Tensor& weight) {
  const char* op = "tk_cuda::hedgehog_features";
  la::HedgehogMapArgs a = map_args(op, x, weight);
  const binding::DeviceGuard guard(x.get_device_index());
  Tensor phi = torch::stable::new_empty(x, Sizes{x.size(0), x.size(1), x.size(2), a.F});
  if (phi.numel() == 0) return phi;
  const Tensor xx = binding::rows16(x), wt = weight_t(weight);
  a.x = xx.data_ptr(), a.weight_t = wt.data_ptr(), a.features = phi.data_ptr();
  for (int d = 0; d < 3; ++d) a.x_stride[d] = xx.stride(d);
  const char* err = la::launch_hedgehog_features(a, binding::current_stream(x));
  STD_TORCH_CHECK(err == nullptr, op, ": ", err ? err : "");
  return phi;
}

std::tuple<Tensor, Tensor> hedgehog_features_backward(const Tensor& grad_features, const Tensor& x,
                                                      const Tensor& weight) {
  const char* op = "tk_cuda::hedgehog_features_backward";
  la::HedgehogMapArgs a = map_args(op, x, weight);
  STD_TORCH_CHECK(grad_features.dim() == 4 && grad_features.size(0) == x.size(0) &&
                      grad_features.size(1) == x.size(1) && grad_features.size(2) == x.size(2) &&
                      grad_features.size(3) == a.F && binding::same_device(grad_features, x),
                  op, ": grad_features must be (B, H, N, 2f) on x's device");
  const binding::DeviceGuard guard(x.get_device_index());
  Tensor dx = torch::stable::new_empty(x, x.sizes());
  Tensor dz = torch::stable::new_empty(x, Sizes{x.size(0), x.size(1), x.size(2), a.F / 2});
  if (dx.numel() == 0) return {dx, dz};
  const Tensor xx = binding::rows16(x), wt = weight_t(weight);
  const Tensor df = torch::stable::contiguous(binding::to(grad_features, ScalarType::BFloat16));
  a.x = xx.data_ptr(), a.weight_t = wt.data_ptr(), a.features = const_cast<void*>(df.data_ptr());
  a.dx = dx.data_ptr(), a.dz = dz.data_ptr();
  for (int d = 0; d < 3; ++d) a.x_stride[d] = xx.stride(d);
  const char* err = la::launch_hedgehog_features_backward(a, binding::current_stream(x));
  STD_TORCH_CHECK(err == nullptr, op, ": ", err ? err : "");
  return {dx, dz};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("linear_attention(Tensor q, Tensor k, Tensor v, str feature_map, Tensor? q_weight=None, "
        "Tensor? k_weight=None, float scale=1.0, bool normalize=False, float eps=0.0) -> Tensor");
  m.def("linear_attention_backward(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, str feature_map, "
        "Tensor? q_weight, Tensor? k_weight, float scale, bool normalize, float eps) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("hedgehog_features(Tensor x, Tensor weight) -> Tensor");
  m.def("hedgehog_features_backward(Tensor grad_features, Tensor x, Tensor weight) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("linear_attention", TORCH_BOX(&linear_attention));
  m.impl("linear_attention_backward", TORCH_BOX(&linear_attention_backward));
  m.impl("hedgehog_features", TORCH_BOX(&hedgehog_features));
  m.impl("hedgehog_features_backward", TORCH_BOX(&hedgehog_features_backward));
}
