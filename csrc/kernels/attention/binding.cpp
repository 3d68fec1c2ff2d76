// Registers tk_cuda::attention and tk_cuda::attention_backward (the schemas of the tk:: ops in
// tk_inductor/ops/attention.py, with window 0 and softcap 0 for none, and the interval tables of padding masks and
// packed sequences that tk::attention_varlen builds: row_keys for the forward, key_rows for the backward). Checks
// inputs, allocates outputs and scratch, and calls the torch-free launchers on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cmath>
#include <optional>
#include <string>
#include <torch/library.h>

#include "attention.h"
#include "binding/operand.h"

namespace {

using tk_attn::DType;
using tk_attn::View4;

View4 view(const at::Tensor& t) {
  return View4{t.data_ptr(), t.size(0), t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2)};
}

// Check messages are assembled with std::to_string: on the device image,
// streaming integers through c10::str inside this library crashed (segfault
// in the ostream number formatting) while string-only messages worked.
std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

void check(bool ok, const std::string& message) {
  TORCH_CHECK(ok, std::string("tk_cuda::attention: ") + message);
}

DType check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   int64_t max_head_dim = tk_attn::kMaxHeadDim) {
  check(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
        "q, k, v must be 4-D (B, H, N, D), got " + shape_str(q) + ", " + shape_str(k) + ", " + shape_str(v));
  check(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k, v must be CUDA tensors");
  check(q.device() == k.device() && q.device() == v.device(), "q, k, v on different devices");
  check(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v must share a dtype");
  check(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
        std::string("dtype must be bfloat16 or float16, got ") + c10::toString(q.scalar_type()));
  check(tk_attn::head_dim_supported(q.size(3), max_head_dim), "head dim must be a multiple of 8 up to " +
                                                                std::to_string(max_head_dim) + ", got " +
                                                                std::to_string(q.size(3)));
  check(k.size(3) == q.size(3) && v.size(3) == q.size(3), "q, k, v head dims differ");
  check(k.sizes() == v.sizes(), "k and v shapes differ: " + shape_str(k) + " vs " + shape_str(v));
  check(k.size(0) == q.size(0), "batch sizes differ");
  check(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, "query heads (" + std::to_string(q.size(1)) +
                                                           ") must be a multiple of kv heads (" +
                                                           std::to_string(k.size(1)) + ")");
  check(q.size(2) >= 1 && k.size(2) >= 1, "sequence lengths must be >= 1");
  check(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the last dim of q, k, v must be contiguous");
  check(q.size(2) < (1LL << 31) && k.size(2) < (1LL << 31), "sequence too long");
  return q.scalar_type() == at::kBFloat16 ? DType::bf16 : DType::f16;
}

// An empty tensor of t's (B, H, N, D) shape viewing a (B, N, H, D) buffer, as FlashAttention returns o.
at::Tensor empty_bnhd(const at::Tensor& t) {
  return at::empty({t.size(0), t.size(2), t.size(1), t.size(3)}, t.options()).transpose(1, 2);
}

// A gradient laid out as its input: (B, N, H, D) memory order when the input's heads lie inside its sequence dim
// (HF's `proj(x).view(B, N, H, D).transpose(1, 2)`), so that the projection's backward reads it without a copy;
// contiguous otherwise. tk_inductor/ops/attention.py `grad_like` states the same rule for the fake and the reference.
at::Tensor grad_like(const at::Tensor& t) {
  if (t.size(1) > 1 && t.size(2) > 1 && t.stride(1) < t.stride(2)) return empty_bnhd(t);
  return at::empty(t.sizes(), t.options());
}

int num_sms(const at::Tensor& t) {
  int n = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, t.get_device()) == cudaSuccess,
              "tk_cuda::attention: cannot query the multiprocessor count");
  return n;
}

// The score function's arguments (tk_attn::Scores), checked.
tk_attn::Scores scores(bool causal, double scale, int64_t window, double softcap) {
  check(window >= 0 && window < (1LL << 31), "window must be >= 0 (0: none), got " + std::to_string(window));
  check(window == 0 || causal, "a sliding window needs causal=True");
  check(softcap >= 0.0 && std::isfinite(softcap), "softcap must be finite and >= 0 (0: none)");
  return {causal, static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap)};
}

// An interval table's data (Scores::row_keys, key_rows): a contiguous int32 (B, rows, 2) tensor on q's device, or
// null. Its monotonicity is the caller's contract (the tk:: ops build the tables).
const int* intervals(const std::optional<at::Tensor>& table, const at::Tensor& q, int64_t rows, const char* name) {
  if (!table.has_value()) return nullptr;
  const at::Tensor& t = *table;
  check(t.scalar_type() == at::kInt && t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == rows && t.size(2) == 2 &&
            t.is_contiguous() && t.device() == q.device(),
        std::string(name) + " must be a contiguous int32 (B, " + std::to_string(rows) + ", 2) tensor on q's device, got " +
            shape_str(t));
  return t.data_ptr<int>();
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                             bool causal, double scale, int64_t window, double softcap,
                                             const std::optional<at::Tensor>& row_keys) {
  const DType dt = check_inputs(q_in, k_in, v_in);
  tk_attn::Scores sc = scores(causal, scale, window, softcap);
  sc.row_keys = intervals(row_keys, q_in, q_in.size(2), "row_keys");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = binding::rows16(q_in), k = binding::rows16(k_in), v = binding::rows16(v_in);
  at::Tensor o = empty_bnhd(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.size(2) <= tk_attn::kDecodeRows && k.size(0) * k.size(1) < 65536) {  // the split-KV kernels (grid z)
    const tk_attn::DecodePlan plan = tk_attn::attention_decode_plan(dt, view(q), view(k), num_sms(q));
    at::Tensor part_o, part_lse;
    if (plan.splits > 1) {
      part_o = at::empty({plan.partial_floats}, q.options().dtype(at::kFloat));
      part_lse = at::empty({plan.partial_rows}, q.options().dtype(at::kFloat));
    }
    const char* err = tk_attn::attention_decode(dt, view(q), view(k), view(v), o.data_ptr(), lse.data_ptr<float>(), sc,
                                                plan, part_o.defined() ? part_o.data_ptr<float>() : nullptr,
                                                part_lse.defined() ? part_lse.data_ptr<float>() : nullptr,
                                                c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == nullptr, "tk_cuda::attention: ", err ? err : "");
    return {o, lse};
  }
  // The dynamic schedule under a causal mask (its tasks differ in length; H200: 1.03-1.25x the static one there,
  // 0.89-1.0x without a mask). Its task counter comes from the stream-ordered allocator, so launches on several
  // streams never share one; zeroed by a memset node rather than at::zeros' fill kernel: less host time per call.
  at::Tensor next_task;
  if (causal) {
    next_task = at::empty({1}, q.options().dtype(at::kInt));
    TORCH_CHECK(cudaMemsetAsync(next_task.data_ptr<int>(), 0, sizeof(int), c10::cuda::getCurrentCUDAStream()) ==
                    cudaSuccess,
                "tk_cuda::attention: cannot zero the task counter");
  }
  const char* err = tk_attn::attention_forward(dt, view(q), view(k), view(v), o.data_ptr(), lse.data_ptr<float>(), sc,
                                               num_sms(q),
                                               next_task.defined() ? next_task.data_ptr<int>() : nullptr,
                                               c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, "tk_cuda::attention: ", err ? err : "");
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& grad_o, const at::Tensor& q_in,
                                                                  const at::Tensor& k_in, const at::Tensor& v_in,
                                                                  const at::Tensor& o_in, const at::Tensor& lse_in,
                                                                  bool causal, double scale, int64_t window,
                                                                  double softcap,
                                                                  const std::optional<at::Tensor>& key_rows) {
  const DType dt = check_inputs(q_in, k_in, v_in, tk_attn::kMaxBackwardHeadDim);
  tk_attn::Scores sc = scores(causal, scale, window, softcap);
  sc.key_rows = intervals(key_rows, q_in, k_in.size(2), "key_rows");
  TORCH_CHECK(grad_o.sizes() == q_in.sizes() && o_in.sizes() == q_in.sizes(),
              "tk_cuda::attention_backward: grad_o and o must have q's shape " + shape_str(q_in));
  TORCH_CHECK(grad_o.scalar_type() == q_in.scalar_type() && o_in.scalar_type() == q_in.scalar_type(),
              "tk_cuda::attention_backward: grad_o and o must have q's dtype");
  TORCH_CHECK(grad_o.device() == q_in.device() && o_in.device() == q_in.device() && lse_in.device() == q_in.device(),
              "tk_cuda::attention_backward: all tensors must be on one device");
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.dim() == 3 && lse_in.size(0) == q_in.size(0) &&
                  lse_in.size(1) == q_in.size(1) && lse_in.size(2) == q_in.size(2),
              "tk_cuda::attention_backward: lse must be float32 (B, Hq, N)");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = binding::rows16(q_in), k = binding::rows16(k_in), v = binding::rows16(v_in);
  const at::Tensor dout = binding::rows16(grad_o);
  const at::Tensor o = binding::rows16(o_in);  // the pre-kernel reads o and grad_o in 16-byte rows
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor dq = grad_like(q_in), dk = grad_like(k_in), dv = grad_like(v_in);
  const View4 qv = view(q);
  const tk_attn::BwdScratch sz = tk_attn::attention_backward_scratch(qv);
  // zeroed by the backward's pre-kernel
  at::Tensor dq_accum = at::empty({static_cast<int64_t>(sz.dq_accum_bytes / 4)}, q.options().dtype(at::kFloat));
  at::Tensor lse2 = at::empty({static_cast<int64_t>(sz.lse2_bytes / 4)}, q.options().dtype(at::kFloat));
  at::Tensor delta = at::empty({static_cast<int64_t>(sz.delta_bytes / 4)}, q.options().dtype(at::kFloat));
  const char* err = tk_attn::attention_backward(
      dt, view(dout), qv, view(k), view(v), view(o), lse.data_ptr<float>(), view(dq), view(dk), view(dv),
      dq_accum.data_ptr<float>(), lse2.data_ptr<float>(), delta.data_ptr<float>(), sc, num_sms(q),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, "tk_cuda::attention_backward: ", err ? err : "");
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, bool causal, float scale, int window=0, float softcap=0., "
      "Tensor? row_keys=None) -> (Tensor o, Tensor lse)");
  m.def(
      "attention_backward(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, float scale, "
      "int window=0, float softcap=0., Tensor? key_rows=None) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("attention", &attention);
  m.impl("attention_backward", &attention_backward);
}
