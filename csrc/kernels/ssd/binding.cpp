// Registers the SSD kernels as the raw ops tk_cuda::ssd and tk_cuda::ssd_backward, with the schemas of the
// user-facing tk:: ops. tk_inductor/ops/ssd.py calls them only for what `kernel_supports` accepts (n 16, 32, 64 or 128, p a
// multiple of 64); the checks here guard direct calls. The kernel takes one layout (ssd.h): inputs in other dtypes or strides (HF
// Mamba2 hands over fp32 x and B/C with the sequence axis innermost) are converted here first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ssd.h"
#include "binding/operand.h"

namespace {

using at::Tensor;

Tensor as(const Tensor& t, at::ScalarType dtype) { return binding::dense(t.to(dtype)); }

// dt as the kernels read it: (b, nh, l_pad) fp32, the sequence innermost and zero-padded to whole 64-token chunks
// (each chunk's values are one contiguous copy; padded tokens have no decay and no input).
Tensor dt_by_head(const Tensor& dt) {
  const int64_t b = dt.size(0), l = dt.size(1), nh = dt.size(2), l_pad = (l + 63) / 64 * 64;
  Tensor dtt = at::zeros({b, nh, l_pad}, dt.options().dtype(at::kFloat));
  dtt.narrow(2, 0, l).copy_(dt.permute({0, 2, 1}));
  return dtt;
}

// The checks both ops share; `op` names the raw op in the messages.
void check_inputs(const char* op, const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B,
                  const Tensor& C, const std::optional<Tensor>& D, const std::optional<Tensor>& initial_state) {
  TORCH_CHECK(x.is_cuda() && dt.is_cuda() && A.is_cuda() && B.is_cuda() && C.is_cuda(), op,
              ": inputs must be CUDA tensors");
  TORCH_CHECK(x.dim() == 4 && dt.dim() == 3 && A.dim() == 1 && B.dim() == 4 && C.sizes() == B.sizes(), op,
              ": x (b, l, nh, p), dt (b, l, nh), A (nh), B and C (b, l, ng, n)");
  const int64_t b = x.size(0), l = x.size(1), nh = x.size(2), p = x.size(3), ng = B.size(2), n = B.size(3);
  TORCH_CHECK(dt.size(0) == b && dt.size(1) == l && dt.size(2) == nh && A.size(0) == nh && B.size(0) == b &&
                  B.size(1) == l && ng >= 1 && nh % ng == 0,
              op, ": shapes disagree");
  TORCH_CHECK(tk_ssd::state_size_supported(int(n)), op, ": the kernel takes state size n 16, 32, 64 or 128, got ", n);
  TORCH_CHECK(p % tk_ssd::P_TILE == 0 && p > 0, op, ": the kernel takes head dims p that are multiples of ",
              tk_ssd::P_TILE, ", got ", p);
  if (D && D->defined()) TORCH_CHECK(D->dim() == 1 && D->size(0) == nh, op, ": D must be (nh)");
  if (initial_state && initial_state->defined())
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({b, nh, p, n}), op, ": initial_state must be (b, nh, p, n)");
  TORCH_CHECK(b * nh * (p / tk_ssd::P_TILE) <= 0x7fffffff && l <= 0x7fffffff, op, ": too large");
}

std::tuple<Tensor, Tensor> ssd(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                               const std::optional<Tensor>& D, const std::optional<Tensor>& initial_state,
                               int64_t chunk_size) {
  (void)chunk_size;  // the result does not depend on it; the kernel uses chunks of 64
  check_inputs("tk_cuda::ssd", x, dt, A, B, C, D, initial_state);
  const int64_t b = x.size(0), l = x.size(1), nh = x.size(2), p = x.size(3), ng = B.size(2), n = B.size(3);
  const bool has_d = D && D->defined(), has_h0 = initial_state && initial_state->defined();
  const c10::cuda::CUDAGuard guard(x.device());
  const auto f32 = x.options().dtype(at::kFloat);
  if (l == 0 || b == 0 || nh == 0) {
    Tensor state = has_h0 ? as(*initial_state, at::kFloat).clone() : at::zeros({b, nh, p, n}, f32);
    return {at::empty(x.sizes(), x.options()), state};
  }
  const Tensor xb = as(x, at::kBFloat16), Af = as(A, at::kFloat);
  const Tensor Bb = as(B, at::kBFloat16), Cb = as(C, at::kBFloat16);
  const Tensor Df = has_d ? as(*D, at::kFloat) : Tensor(), h0 = has_h0 ? as(*initial_state, at::kFloat) : Tensor();
  const Tensor dtt = dt_by_head(dt);
  const int64_t l_pad = dtt.size(2);
  const bool y_bf16 = x.scalar_type() == at::kBFloat16;  // else fp32, cast to x's dtype below
  Tensor y = at::empty({b, l, nh, p}, x.options().dtype(y_bf16 ? at::kBFloat16 : at::kFloat));
  Tensor h_final = at::empty({b, nh, p, n}, f32);
  // a sequence split into segments (few tasks for the SMs) needs each segment's state and decay
  const int segments = tk_ssd::scan_segments(int(b), int(l), int(nh), int(ng), int(p));
  Tensor seg_states, seg_decay;
  if (segments > 1) seg_states = at::empty({b, nh, segments, p, n}, f32), seg_decay = at::empty({b, nh, segments}, f32);
  tk_ssd::Args a{};
  a.x = xb.data_ptr(), a.dt = dtt.data_ptr<float>(), a.A = Af.data_ptr<float>();
  a.B = Bb.data_ptr(), a.C = Cb.data_ptr();
  a.D = has_d ? Df.data_ptr<float>() : nullptr;
  a.h0 = has_h0 ? h0.data_ptr<float>() : nullptr;
  a.y = y.data_ptr(), a.y_bf16 = y_bf16, a.h_final = h_final.data_ptr<float>();
  a.b = int(b), a.l = int(l), a.l_pad = int(l_pad), a.nh = int(nh), a.ng = int(ng), a.p = int(p), a.n = int(n);
  a.segments = segments;
  a.seg_states = segments > 1 ? seg_states.data_ptr<float>() : nullptr;
  a.seg_decay = segments > 1 ? seg_decay.data_ptr<float>() : nullptr;
  const char* err = tk_ssd::launch(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, "tk_cuda::ssd: ", err ? err : "");
  return {y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type()), h_final};
}

// (dx, ddt, dA, dB, dC, dD, dinitial_state), the op's schema and dtypes. The kernels give dx, dB, dC, dD and dh0, and
// per token dlam = C·dC − B·dB (per head) and Σ_p x·dX (X = dt·x), and each chunk's anchor ⟨∂L/∂h, h⟩ at its end; the
// rest is small (b, l, nh) work (ssd/README.md, "Backward"): da is dlam summed from the back inside each 64-token
// chunk plus the chunk's anchor, ddt = Σ_p x·dX + A·da, dA = Σ dt·da.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ssd_backward(
    const Tensor& grad_y, const Tensor& grad_state, const Tensor& x, const Tensor& dt, const Tensor& A,
    const Tensor& B, const Tensor& C, const std::optional<Tensor>& D, const std::optional<Tensor>& initial_state,
    int64_t chunk_size) {
  (void)chunk_size;
  const char* op = "tk_cuda::ssd_backward";
  check_inputs(op, x, dt, A, B, C, D, initial_state);
  const int64_t b = x.size(0), l = x.size(1), nh = x.size(2), p = x.size(3), ng = B.size(2), n = B.size(3);
  TORCH_CHECK(grad_y.is_cuda() && grad_state.is_cuda() && grad_y.sizes() == x.sizes() &&
                  grad_state.sizes() == at::IntArrayRef({b, nh, p, n}),
              op, ": grad_y must be (b, l, nh, p) and grad_state (b, nh, p, n), on CUDA");
  const bool has_d = D && D->defined(), has_h0 = initial_state && initial_state->defined();
  const c10::cuda::CUDAGuard guard(x.device());
  const auto f32 = x.options().dtype(at::kFloat);
  const Tensor dtf = as(dt, at::kFloat), Af = as(A, at::kFloat), dh = as(grad_state, at::kFloat);
  // what an empty sequence gives (the kernels write dx and dh0); the rest: heads and head-dim tiles add into them
  constexpr int64_t chunk = 64;  // the kernels' (ssd.cuh CHUNK)
  const int64_t chunks = (l + chunk - 1) / chunk;
  Tensor dx = at::empty({b, l, nh, p}, x.options().dtype(at::kBFloat16));
  Tensor dB = at::zeros({b, l, ng, n}, f32), dC = at::zeros({b, l, ng, n}, f32);
  Tensor dlam = at::zeros({b, l, nh}, f32), xdX = at::zeros({b, l, nh}, f32), dDf = at::zeros({nh}, f32);
  Tensor dh0 = dh.clone(), anchor = at::zeros({b, nh, chunks}, f32);
  if (l > 0 && b > 0 && nh > 0) {
    const Tensor xb = as(x, at::kBFloat16), dyb = as(grad_y, at::kBFloat16);
    const Tensor Bb = as(B, at::kBFloat16), Cb = as(C, at::kBFloat16);
    const Tensor h0 = has_h0 ? as(*initial_state, at::kFloat) : Tensor(), Df = has_d ? as(*D, at::kFloat) : Tensor();
    const Tensor dtt = dt_by_head(dt);
    tk_ssd::BwdArgs a{};
    a.x = xb.data_ptr(), a.dy = dyb.data_ptr(), a.dt = dtt.data_ptr<float>(), a.A = Af.data_ptr<float>();
    a.B = Bb.data_ptr(), a.C = Cb.data_ptr(), a.h0 = has_h0 ? h0.data_ptr<float>() : nullptr;
    a.D = has_d ? Df.data_ptr<float>() : nullptr, a.dh = dh.data_ptr<float>(), a.dx = dx.data_ptr();
    a.dB = dB.data_ptr<float>(), a.dC = dC.data_ptr<float>(), a.dlam = dlam.data_ptr<float>();
    a.xdX = xdX.data_ptr<float>(), a.dD = has_d ? dDf.data_ptr<float>() : nullptr;
    a.dh0 = dh0.data_ptr<float>(), a.anchor = anchor.data_ptr<float>();
    Tensor chunk_states = at::empty({b * nh * p * chunks * n}, x.options().dtype(at::kBFloat16));
    a.chunk_states = chunk_states.data_ptr();
    const int segments = tk_ssd::scan_segments(int(b), int(l), int(nh), int(ng), int(p));
    Tensor seg_states, seg_grads, seg_decay;
    if (segments > 1) {
      seg_states = at::empty({b, nh, segments, p, n}, f32), seg_grads = at::empty({b, nh, segments, p, n}, f32);
      seg_decay = at::empty({b, nh, segments}, f32);
    }
    a.segments = segments;
    a.seg_states = segments > 1 ? seg_states.data_ptr<float>() : nullptr;
    a.seg_grads = segments > 1 ? seg_grads.data_ptr<float>() : nullptr;
    a.seg_decay = segments > 1 ? seg_decay.data_ptr<float>() : nullptr;
    a.b = int(b), a.l = int(l), a.l_pad = int(dtt.size(2)), a.nh = int(nh), a.ng = int(ng), a.p = int(p), a.n = int(n);
    const char* err = tk_ssd::launch_backward(a, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == nullptr, op, ": ", err ? err : "");
  }
  // da: dlam summed from the back inside each chunk, plus the chunk's anchor (the later chunks' exact share)
  Tensor padded = at::zeros({b, chunks * chunk, nh}, f32);
  padded.narrow(1, 0, l).copy_(dlam);
  // (the anchors also fix each chunk's own sum, anchor_{c-1} − anchor_c, but g's bf16 roundings make them no more
  // accurate than that sum: pinning the sums to them was worse in emulation, 3x worse at 64 tokens on the H200)
  const Tensor da = padded.view({b, chunks, chunk, nh})
                        .flip({2}).cumsum(2).flip({2})
                        .add(anchor.permute({0, 2, 1}).unsqueeze(2))
                        .view({b, chunks * chunk, nh})
                        .narrow(1, 0, l);
  const Tensor ddt = xdX.add(Af.mul(da));
  const Tensor dA = dtf.mul(da).sum(at::IntArrayRef{0, 1});
  // absent gradients: empty, in x's dtype (as the op's fake)
  const Tensor dD = has_d ? dDf.to(D->scalar_type()) : at::empty({0}, x.options());
  const Tensor dinit = has_h0 ? dh0.to(initial_state->scalar_type()) : at::empty({0}, x.options());
  return {dx.to(x.scalar_type()), ddt.to(dt.scalar_type()), dA.to(A.scalar_type()), dB.to(B.scalar_type()),
          dC.to(C.scalar_type()), dD, dinit};
}

// The segments per sequence tk_cuda::ssd and tk_cuda::ssd_backward split each scan into on the current device
// (1: none).
int64_t ssd_segments(int64_t b, int64_t l, int64_t nh, int64_t ng, int64_t p) {
  return tk_ssd::scan_segments(int(b), int(l), int(nh), int(ng), int(p));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("ssd_segments(int b, int l, int nh, int ng, int p) -> int", &ssd_segments);
  m.def("ssd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D=None, Tensor? initial_state=None, "
        "int chunk_size=64) -> (Tensor, Tensor)");
  m.def("ssd_backward(Tensor grad_y, Tensor grad_state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
        "Tensor? D, Tensor? initial_state, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("ssd", &ssd);
  m.impl("ssd_backward", &ssd_backward);
}
