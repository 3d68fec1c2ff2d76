#pragma once
// Host side of the bindings on torch's stable ABI (torch/csrc/stable: tensors, ops and registration through the C
// shim), whose headers compile in a fraction of the time of ATen's and torch/library.h (the largest part of every
// family's build). Operands in a form the kernels' 16-byte loads (vectors, cp.async, TMA) can read: any tensor a user
// can pass is accepted; one the kernels cannot read in place is copied once.

// shim.h declares its CUDA entry points (the current CUDA stream) only under USE_CUDA; it must see it first.
#ifndef USE_CUDA
#define USE_CUDA
#endif
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace binding {

using Tensor = torch::stable::Tensor;
using OptTensor = std::optional<Tensor>;
using ScalarType = torch::headeronly::ScalarType;

using Sizes = std::vector<int64_t>;  // a shape to allocate (torch::stable ops take it as an array ref)

inline bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// A zero-filled CPU tensor of n elements.
inline Tensor cpu_zeros(int64_t n, ScalarType dtype) {
  Tensor t = torch::stable::empty(Sizes{n}, dtype, std::nullopt,
                                  torch::stable::Device(torch::headeronly::DeviceType::CPU));
  return torch::stable::zero_(t);
}

inline bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// t row-major on a 16-byte aligned base: t itself when it already is, else a copy. (`contiguous()` alone keeps a
// contiguous view at an unaligned storage offset, such as `flat[1:]`, where a 16-byte load faults.)
inline Tensor dense(const Tensor& t) {
  Tensor c = torch::stable::contiguous(t);
  return aligned16(c) ? c : torch::stable::clone(c);
}
inline OptTensor dense(const OptTensor& t) { return present(t) ? OptTensor(dense(*t)) : t; }

// t with its own strides when every row starts 16-byte aligned (unit last stride, aligned base, the other strides
// whole 16-byte multiples or their sizes 1), else dense(t): layouts such as (B, N, H, D) seen as (B, H, N, D) are
// read in place.
inline Tensor rows16(const Tensor& t) {
  const int64_t per16 = 16 / int64_t(t.element_size());
  bool ok = t.dim() > 0 && t.stride(-1) == 1 && aligned16(t);
  for (int64_t d = 0; d + 1 < t.dim() && ok; ++d) ok = t.size(d) == 1 || t.stride(d) % per16 == 0;
  return ok ? t : dense(t);
}

// The current CUDA stream of t's device (what torch's own kernels run on).
inline cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  return static_cast<cudaStream_t>(stream);
}

// Sets a device as the current one for the scope (torch's CUDAGuard): `DeviceGuard guard(t.get_device_index())`.
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

inline const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Bool: return "torch.bool";
    default: return "another dtype";
  }
}

// An aten op that torch::stable does not wrap, through the dispatcher: `name.overload(args...)`'s first output. Every
// argument of the schema is passed (no defaults); Scalar arguments cannot be (the stable values have no Scalar).
template <class... Args>
Tensor call(const char* name, const char* overload, const Args&... args) {
  std::array<StableIValue, sizeof...(Args)> stack{torch::stable::detail::from(args)...};
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

// An uninitialised tensor of t's sizes, device and layout (its strides, where t is dense) with another dtype.
inline Tensor empty_like(const Tensor& t, ScalarType dtype) {
  return call("aten::empty_like", "", t, std::optional<ScalarType>(dtype), std::nullopt, std::nullopt, std::nullopt,
              std::nullopt);
}

// t converted to dtype (t itself when it has it).
inline Tensor to(const Tensor& t, ScalarType dtype) { return torch::stable::to(t, dtype); }

// The dtype eager gives a binary op of two floating dtypes (torch.promote_types).
inline ScalarType promote_floats(ScalarType a, ScalarType b) {
  if (a == b) return a;
  if (a == ScalarType::Double || b == ScalarType::Double) return ScalarType::Double;
  return ScalarType::Float;  // fp32 with a 16-bit type, or bf16 with fp16
}

inline bool same_device(const Tensor& a, const Tensor& b) {
  return a.is_cuda() == b.is_cuda() && a.get_device_index() == b.get_device_index();
}

inline bool same_sizes(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) != b.size(d)) return false;
  return true;
}

// The multiprocessor count of t's device.
inline int num_sms(const Tensor& t) {
  int n = 0;
  STD_TORCH_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, t.get_device_index()) == cudaSuccess,
                  "cannot query the multiprocessor count");
  return n;
}

template <typename T>
T* data(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// A family's dropout arguments (its torch-free DropoutArgs: enabled, seed, offset, threshold, scale) from the
// probability and the (seed, offset) pair the op was given (a CPU int64 tensor of two elements,
// tk_inductor/ops/philox.py's draw_seed), with the reference's threshold(p) = min(floor(p * 2^32), 2^32 - 1) and
// dropout_scale(p) = 1 / (1 - p) in fp32. p <= 0: none (enabled false, rng not read).
template <class Args>
Args philox(const char* op, double p, const OptTensor& rng) {
  Args d;
  if (p <= 0.0) return d;
  STD_TORCH_CHECK(p < 1.0, op, ": dropout p must be < 1");
  STD_TORCH_CHECK(present(rng) && rng->is_cpu() && rng->scalar_type() == ScalarType::Long && rng->numel() == 2, op,
                  ": dropout needs rng = CPU int64 tensor (seed, offset)");
  const Tensor r = torch::stable::contiguous(*rng);
  const int64_t* v = static_cast<const int64_t*>(r.data_ptr());
  d.enabled = true;
  d.seed = static_cast<uint64_t>(v[0]);
  d.offset = static_cast<uint64_t>(v[1]);
  const double t = std::floor(p * 4294967296.0);
  d.threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
  d.scale = static_cast<float>(1.0 / (1.0 - p));
  return d;
}

inline std::string shape_str(const Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

}  // namespace binding
