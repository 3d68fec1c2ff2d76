// Registers the Based forward kernel as the raw op tk_cuda::linear_attention, with the schema of the user-facing
// tk::linear_attention. tk_inductor/ops/linear_attention.py calls it only for what `kernel_supports` accepts
// (feature map "based", bf16, dk 16, dv a multiple of 64, no weights); the checks here guard direct calls.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "linear_attention.h"
#include "tk/env.h"

namespace {

using at::Tensor;
namespace la = tk_linear_attention;

// The kernel variant (linear_attention.h): TK_BASED_VARIANT, read on every call; unset = chosen by the kernel from
// the block count.
int variant() {
  int v = la::BASED_AUTO;
  TORCH_CHECK(tk::env_variant("TK_BASED_VARIANT", la::BASED_VARIANTS, v), "TK_BASED_VARIANT must be an integer in [0, ",
              la::BASED_VARIANTS, "), got '", std::getenv("TK_BASED_VARIANT"), "'");
  return v;
}

// cp.async moves 16-byte row segments: rows must start 16-byte aligned with a unit stride inside.
Tensor loadable(const Tensor& t) {
  const bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
                  t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
  return ok ? t : t.contiguous();
}

Tensor linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view feature_map,
                        const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight, double scale,
                        bool normalize, double eps) {
  TORCH_CHECK(feature_map == "based", "tk_cuda::linear_attention: the kernel implements feature map 'based', not '",
              std::string(feature_map), "'");
  TORCH_CHECK(!(q_weight && q_weight->defined()) && !(k_weight && k_weight->defined()),
              "tk_cuda::linear_attention: 'based' takes no weights");
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "tk_cuda::linear_attention: inputs must be CUDA tensors");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              "tk_cuda::linear_attention: q, k (B, H, N, 16) and v (B, H, N, dv) must agree");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "tk_cuda::linear_attention: the kernel takes bfloat16");
  TORCH_CHECK(q.size(3) == la::BASED_DK, "tk_cuda::linear_attention: q/k feature dim must be ", la::BASED_DK);
  TORCH_CHECK(v.size(3) % la::BASED_DV_TILE == 0 && v.size(3) > 0,
              "tk_cuda::linear_attention: dv must be a positive multiple of ", la::BASED_DV_TILE);
  TORCH_CHECK(q.size(2) <= 0x7fffffff && q.size(0) * q.size(1) <= 0x7fffffff, "tk_cuda::linear_attention: too large");
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor o = at::empty(v.sizes(), v.options());
  if (o.numel() == 0) return o;
  const Tensor qq = loadable(q), kk = loadable(k), vv = loadable(v);
  la::BasedArgs a{};
  a.q = qq.data_ptr(), a.k = kk.data_ptr(), a.v = vv.data_ptr(), a.o = o.data_ptr();
  a.B = int(q.size(0)), a.H = int(q.size(1)), a.N = int(q.size(2)), a.dv = int(v.size(3));
  for (int d = 0; d < 3; ++d) {
    a.q_stride[d] = qq.stride(d), a.k_stride[d] = kk.stride(d), a.v_stride[d] = vv.stride(d);
  }
  a.scale = float(scale), a.normalize = normalize, a.eps = float(eps);
  a.variant = variant();
  const char* err = la::launch_based(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, "tk_cuda::linear_attention: ", err ? err : "");
  return o;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("linear_attention(Tensor q, Tensor k, Tensor v, str feature_map, Tensor? q_weight=None, "
        "Tensor? k_weight=None, float scale=1.0, bool normalize=False, float eps=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) { m.impl("linear_attention", &linear_attention); }
