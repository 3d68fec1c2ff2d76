// Registers tk_cuda::attention and tk_cuda::attention_backward (the schemas of the tk:: ops in
// tk_inductor/ops/attention.py, with window 0 and softcap 0 for none, the interval tables of padding masks and
// packed sequences that tk::attention_varlen builds: row_keys for the forward, key_rows for the backward, the
// dropout probability with its (seed, offset) pair, and the backward's optional gradient of lse). Checks inputs, allocates outputs and scratch, and calls the
// torch-free launchers on the current stream.
#include "binding/stable.h"

#include <cmath>
#include <optional>
#include <string>

#include "attention.h"

namespace {

using binding::data;
using binding::OptTensor;
using binding::ScalarType;
using binding::shape_str;
using binding::Tensor;
using tk_attn::DType;
using tk_attn::View4;

View4 view(const Tensor& t) {
  return View4{t.data_ptr(), t.size(0), t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2)};
}

void check(bool ok, const std::string& message) {
  STD_TORCH_CHECK(ok, "tk_cuda::attention: ", message);
}

DType check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                   int64_t max_head_dim = tk_attn::kMaxHeadDim) {
  check(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
        "q, k, v must be 4-D (B, H, N, D), got " + shape_str(q) + ", " + shape_str(k) + ", " + shape_str(v));
  check(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k, v must be CUDA tensors");
  check(binding::same_device(q, k) && binding::same_device(q, v), "q, k, v on different devices");
  check(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v must share a dtype");
  check(q.scalar_type() == ScalarType::BFloat16 || q.scalar_type() == ScalarType::Half,
        std::string("dtype must be bfloat16 or float16, got ") + binding::dtype_name(q.scalar_type()));
  check(tk_attn::head_dim_supported(q.size(3), max_head_dim), "head dim must be a multiple of 8 up to " +
                                                                std::to_string(max_head_dim) + ", got " +
                                                                std::to_string(q.size(3)));
  check(k.size(3) == q.size(3) && v.size(3) == q.size(3), "q, k, v head dims differ");
  check(binding::same_sizes(k, v), "k and v shapes differ: " + shape_str(k) + " vs " + shape_str(v));
  check(k.size(0) == q.size(0), "batch sizes differ");
  check(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, "query heads (" + std::to_string(q.size(1)) +
                                                           ") must be a multiple of kv heads (" +
                                                           std::to_string(k.size(1)) + ")");
  check(q.size(2) >= 1 && k.size(2) >= 1, "sequence lengths must be >= 1");
  check(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the last dim of q, k, v must be contiguous");
  check(q.size(2) < (1LL << 31) && k.size(2) < (1LL << 31), "sequence too long");
  return q.scalar_type() == ScalarType::BFloat16 ? DType::bf16 : DType::f16;
}

// An empty tensor of t's (B, H, N, D) shape viewing a (B, N, H, D) buffer, as FlashAttention returns o.
Tensor empty_bnhd(const Tensor& t) {
  const Tensor bnhd = torch::stable::new_empty(t, binding::Sizes{t.size(0), t.size(2), t.size(1), t.size(3)});
  return torch::stable::transpose(bnhd, 1, 2);
}

// A gradient laid out as its input: (B, N, H, D) memory order when the input's heads lie inside its sequence dim
// (HF's `proj(x).view(B, N, H, D).transpose(1, 2)`), so that the projection's backward reads it without a copy;
// contiguous otherwise. tk_inductor/ops/attention.py `grad_like` states the same rule for the fake and the reference.
Tensor grad_like(const Tensor& t) {
  if (t.size(1) > 1 && t.size(2) > 1 && t.stride(1) < t.stride(2)) return empty_bnhd(t);
  return torch::stable::new_empty(t, t.sizes());
}

// The score function's arguments (tk_attn::Scores), checked; dropout_p > 0 reads the (seed, offset) pair from rng.
tk_attn::Scores scores(bool causal, double scale, int64_t window, double softcap, double dropout_p,
                       const OptTensor& rng, int64_t head_dim) {
  check(window >= 0 && window < (1LL << 31), "window must be >= 0 (0: none), got " + std::to_string(window));
  check(window == 0 || causal, "a sliding window needs causal=True");
  check(softcap >= 0.0 && std::isfinite(softcap), "softcap must be finite and >= 0 (0: none)");
  check(dropout_p >= 0.0, "dropout_p must be >= 0");
  tk_attn::Scores sc{causal, static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap)};
  sc.dropout = binding::philox<tk_attn::DropoutArgs>("tk_cuda::attention", dropout_p, rng);
  check(!sc.dropout.enabled || (softcap == 0.0 && scale > 0.0), "dropout runs with scale > 0 and without a softcap");
  check(!sc.dropout.enabled || head_dim <= tk_attn::kMaxDropoutHeadDim,
        "dropout takes head dims up to 128, got " + std::to_string(head_dim));
  return sc;
}

// An interval table's data (Scores::row_keys, key_rows): a contiguous int32 (B, rows, 2) tensor on q's device, or
// null. Its monotonicity is the caller's contract (the tk:: ops build the tables).
const int* intervals(const OptTensor& table, const Tensor& q, int64_t rows, const char* name) {
  if (!table.has_value()) return nullptr;
  const Tensor& t = *table;
  check(t.scalar_type() == ScalarType::Int && t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == rows && t.size(2) == 2 &&
            t.is_contiguous() && binding::same_device(t, q),
        std::string(name) + " must be a contiguous int32 (B, " + std::to_string(rows) + ", 2) tensor on q's device, got " +
            shape_str(t));
  return data<int>(t);
}

std::tuple<Tensor, Tensor> attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                             bool causal, double scale, int64_t window, double softcap,
                                             double dropout_p, const OptTensor& rng, const OptTensor& row_keys) {
  const DType dt = check_inputs(q_in, k_in, v_in);
  tk_attn::Scores sc = scores(causal, scale, window, softcap, dropout_p, rng, q_in.size(3));
  sc.row_keys = intervals(row_keys, q_in, q_in.size(2), "row_keys");
  const binding::DeviceGuard guard(q_in.get_device_index());
  const Tensor q = binding::rows16(q_in), k = binding::rows16(k_in), v = binding::rows16(v_in);
  Tensor o = empty_bnhd(q);
  Tensor lse = torch::stable::new_empty(q, binding::Sizes{q.size(0), q.size(1), q.size(2)}, ScalarType::Float);
  const cudaStream_t stream = binding::current_stream(q);
  // the split-KV kernels (grid z; inference: no dropout)
  if (q.size(2) <= tk_attn::kDecodeRows && k.size(0) * k.size(1) < 65536 && !sc.dropout.enabled) {
    const tk_attn::DecodePlan plan = tk_attn::attention_decode_plan(dt, view(q), view(k), binding::num_sms(q));
    const bool split = plan.splits > 1;  // the partials' scratch
    const Tensor part_o = torch::stable::new_empty(q, binding::Sizes{split ? plan.partial_floats : 0}, ScalarType::Float);
    const Tensor part_lse = torch::stable::new_empty(q, binding::Sizes{split ? plan.partial_rows : 0}, ScalarType::Float);
    const char* err = tk_attn::attention_decode(dt, view(q), view(k), view(v), o.data_ptr(), data<float>(lse), sc, plan,
                                                split ? data<float>(part_o) : nullptr,
                                                split ? data<float>(part_lse) : nullptr, stream);
    STD_TORCH_CHECK(err == nullptr, "tk_cuda::attention: ", err ? err : "");
    return {o, lse};
  }
  // The forward kernels keep each row's max on raw scores, which needs scale > 0. Without a softcap another scale is
  // folded into q exactly: s·(q·k) = |s|·((−q)·k) for s < 0, and (s·q)·k with scale 1 for s = 0 or NaN (zeros, or
  // NaNs, where s·(q·k) gives them). The backward takes the original q and scale: the result and lse are the same.
  Tensor q_fwd = q;
  if (!(sc.scale > 0.f) && !(sc.softcap > 0.f)) {
    if (sc.scale < 0.f) {
      q_fwd = binding::call("aten::neg", "", q);
      sc.scale = -sc.scale;
    } else {
      Tensor s = torch::stable::new_empty(q, binding::Sizes{}, ScalarType::Float);
      torch::stable::fill_(s, scale);
      q_fwd = binding::call("aten::mul", "Tensor", q, s);
      sc.scale = 1.f;
    }
  }
  // The dynamic schedule under a causal mask (its tasks differ in length; H200: 1.03-1.25x the static one there,
  // 0.89-1.0x without a mask). Its task counter comes from the stream-ordered allocator, so launches on several
  // streams never share one; zeroed by a memset node rather than at::zeros' fill kernel: less host time per call.
  const Tensor next_task = torch::stable::new_empty(q, binding::Sizes{causal ? 1 : 0}, ScalarType::Int);
  if (causal)
    STD_TORCH_CHECK(cudaMemsetAsync(data<int>(next_task), 0, sizeof(int), stream) == cudaSuccess,
                    "tk_cuda::attention: cannot zero the task counter");
  const char* err = tk_attn::attention_forward(dt, view(q_fwd), view(k), view(v), o.data_ptr(), data<float>(lse), sc,
                                               binding::num_sms(q), causal ? data<int>(next_task) : nullptr, stream);
  STD_TORCH_CHECK(err == nullptr, "tk_cuda::attention: ", err ? err : "");
  return {o, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_backward(const Tensor& grad_o, const Tensor& q_in,
                                                                  const Tensor& k_in, const Tensor& v_in,
                                                                  const Tensor& o_in, const Tensor& lse_in,
                                                                  bool causal, double scale, int64_t window,
                                                                  double softcap,
                                                                  double dropout_p, const OptTensor& rng,
                                                                  const OptTensor& grad_lse,
                                                                  const OptTensor& key_rows) {
  const DType dt = check_inputs(q_in, k_in, v_in, tk_attn::kMaxBackwardHeadDim);
  tk_attn::Scores sc = scores(causal, scale, window, softcap, dropout_p, rng, q_in.size(3));
  sc.key_rows = intervals(key_rows, q_in, k_in.size(2), "key_rows");
  if (grad_lse.has_value()) {
    const Tensor& g = *grad_lse;
    STD_TORCH_CHECK(g.scalar_type() == ScalarType::Float && g.dim() == 3 && g.size(0) == q_in.size(0) &&
                        g.size(1) == q_in.size(1) && g.size(2) == q_in.size(2) && g.is_contiguous() &&
                        binding::same_device(g, q_in),
                    "tk_cuda::attention_backward: grad_lse must be a contiguous float32 (B, Hq, N) tensor on q's "
                    "device, got ", shape_str(g));
    sc.lse_grad = data<float>(g);
  }
  STD_TORCH_CHECK(binding::same_sizes(grad_o, q_in) && binding::same_sizes(o_in, q_in),
                  "tk_cuda::attention_backward: grad_o and o must have q's shape ", shape_str(q_in));
  STD_TORCH_CHECK(grad_o.scalar_type() == q_in.scalar_type() && o_in.scalar_type() == q_in.scalar_type(),
                  "tk_cuda::attention_backward: grad_o and o must have q's dtype");
  STD_TORCH_CHECK(binding::same_device(grad_o, q_in) && binding::same_device(o_in, q_in) &&
                      binding::same_device(lse_in, q_in),
                  "tk_cuda::attention_backward: all tensors must be on one device");
  STD_TORCH_CHECK(lse_in.scalar_type() == ScalarType::Float && lse_in.dim() == 3 && lse_in.size(0) == q_in.size(0) &&
                      lse_in.size(1) == q_in.size(1) && lse_in.size(2) == q_in.size(2),
                  "tk_cuda::attention_backward: lse must be float32 (B, Hq, N)");
  const binding::DeviceGuard guard(q_in.get_device_index());
  const Tensor q = binding::rows16(q_in), k = binding::rows16(k_in), v = binding::rows16(v_in);
  const Tensor dout = binding::rows16(grad_o);
  const Tensor o = binding::rows16(o_in);  // the pre-kernel reads o and grad_o in 16-byte rows
  const Tensor lse = torch::stable::contiguous(lse_in);
  Tensor dq = grad_like(q_in), dk = grad_like(k_in), dv = grad_like(v_in);
  const View4 qv = view(q);
  const tk_attn::BwdScratch sz = tk_attn::attention_backward_scratch(qv);
  // zeroed by the backward's pre-kernel
  const auto floats = [&](size_t bytes) {
    return torch::stable::new_empty(q, binding::Sizes{static_cast<int64_t>(bytes / 4)}, ScalarType::Float);
  };
  const Tensor dq_accum = floats(sz.dq_accum_bytes), lse2 = floats(sz.lse2_bytes), delta = floats(sz.delta_bytes);
  const char* err = tk_attn::attention_backward(
      dt, view(dout), qv, view(k), view(v), view(o), data<float>(lse), view(dq), view(dk), view(dv),
      data<float>(dq_accum), data<float>(lse2), data<float>(delta), sc, binding::num_sms(q),
      binding::current_stream(q));
  STD_TORCH_CHECK(err == nullptr, "tk_cuda::attention_backward: ", err ? err : "");
  return {dq, dk, dv};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, bool causal, float scale, int window=0, float softcap=0., "
      "float dropout_p=0., Tensor? rng=None, Tensor? row_keys=None) -> (Tensor o, Tensor lse)");
  m.def(
      "attention_backward(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, float scale, "
      "int window=0, float softcap=0., float dropout_p=0., Tensor? rng=None, Tensor? grad_lse=None, "
      "Tensor? key_rows=None) -> (Tensor dq, Tensor dk, Tensor dv)");
}

STABLE_TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("attention", TORCH_BOX(&attention));
  m.impl("attention_backward", TORCH_BOX(&attention_backward));
}
