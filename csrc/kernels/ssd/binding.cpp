// Registers the SSD kernels as the raw ops tk_cuda::ssd and tk_cuda::ssd_backward, with the schemas of the
// user-facing tk:: ops, and simple GLA on the same kernels (tk_cuda::simple_gla, tk_cuda::simple_gla_backward; the
// scan without A). They take state sizes n = dk of 16, 32, 64 or 128 and head dims p = dv that are multiples of 64;
// tk_inductor/ops/ssd.py and simple_gla.py run other sizes as parts of those (ops/_state_parts.py), and the checks
// here guard direct calls. The kernel takes one layout (ssd.h): inputs in other dtypes or strides (HF Mamba2 hands
// over fp32 x and B/C with the sequence axis innermost) are converted here first.
#include "binding/stable.h"

#include <optional>
#include <tuple>

#include "ssd.h"

namespace {

using binding::call;
using binding::data;
using binding::OptTensor;
using binding::present;
using binding::ScalarType;
using binding::Sizes;
using binding::Tensor;
using torch::stable::new_empty;
using torch::stable::new_zeros;

Tensor as(const Tensor& t, ScalarType dtype) { return binding::dense(binding::to(t, dtype)); }
// a + b (torch::stable's subtract takes the alpha that the dispatcher's add would need as a Scalar)
Tensor add(const Tensor& a, const Tensor& b) { return torch::stable::subtract(a, b, -1.0); }

// dt as the kernels read it: (b, nh, l_pad) fp32, the sequence innermost and zero-padded to whole 64-token chunks
// (each chunk's values are one contiguous copy; padded tokens have no decay and no input).
Tensor dt_by_head(const Tensor& dt) {
  const int64_t b = dt.size(0), l = dt.size(1), nh = dt.size(2), l_pad = (l + 63) / 64 * 64;
  Tensor dtt = new_zeros(dt, Sizes{b, nh, l_pad}, ScalarType::Float);
  Tensor inner = torch::stable::narrow(dtt, 2, 0, l);
  torch::stable::copy_(inner, call("aten::permute", "", dt, Sizes{0, 2, 1}));
  return dtt;
}

// The checks both ops share; `op` names the raw op in the messages.
void check_inputs(const char* op, const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B,
                  const Tensor& C, const OptTensor& D, const OptTensor& initial_state) {
  STD_TORCH_CHECK(x.is_cuda() && dt.is_cuda() && A.is_cuda() && B.is_cuda() && C.is_cuda(), op,
              ": inputs must be CUDA tensors");
  STD_TORCH_CHECK(x.dim() == 4 && dt.dim() == 3 && A.dim() == 1 && B.dim() == 4 && binding::same_sizes(C, B), op,
              ": x (b, l, nh, p), dt (b, l, nh), A (nh), B and C (b, l, ng, n)");
  const int64_t b = x.size(0), l = x.size(1), nh = x.size(2), p = x.size(3), ng = B.size(2), n = B.size(3);
  STD_TORCH_CHECK(dt.size(0) == b && dt.size(1) == l && dt.size(2) == nh && A.size(0) == nh && B.size(0) == b &&
                  B.size(1) == l && ng >= 1 && nh % ng == 0,
              op, ": shapes disagree");
  STD_TORCH_CHECK(tk_ssd::state_size_supported(int(n)), op, ": the kernel takes state size n 16, 32, 64 or 128, got ", n);
  STD_TORCH_CHECK(p % tk_ssd::P_TILE == 0 && p > 0, op, ": the kernel takes head dims p that are multiples of ",
              tk_ssd::P_TILE, ", got ", p);
  if (present(D)) STD_TORCH_CHECK(D->dim() == 1 && D->size(0) == nh, op, ": D must be (nh)");
  if (present(initial_state))
    STD_TORCH_CHECK(initial_state->dim() == 4 && initial_state->size(0) == b && initial_state->size(1) == nh &&
                        initial_state->size(2) == p && initial_state->size(3) == n,
                    op, ": initial_state must be (b, nh, p, n)");
  STD_TORCH_CHECK(b * nh * (p / tk_ssd::P_TILE) <= 0x7fffffff && l <= 0x7fffffff, op, ": too large");
}

// One forward scan (ssd.h): the SSD, or simple GLA without A. y in x's dtype and the final state (b, nh, p, n) fp32.
std::tuple<Tensor, Tensor> scan(const Tensor& x, const Tensor& dt, const OptTensor& A, const Tensor& B, const Tensor& C,
                                const OptTensor& D, const OptTensor& initial_state, double y_scale) {
  const int64_t b = x.size(0), l = x.size(1), nh = x.size(2), p = x.size(3), ng = B.size(2), n = B.size(3);
  const bool has_d = present(D), has_h0 = present(initial_state);
  const binding::DeviceGuard guard(x.get_device_index());
  const ScalarType f32 = ScalarType::Float, bf16 = ScalarType::BFloat16;
  if (l == 0 || b == 0 || nh == 0) {
    Tensor state = has_h0 ? torch::stable::clone(as(*initial_state, f32)) : new_zeros(x, Sizes{b, nh, p, n}, f32);
    return {new_empty(x, x.sizes()), state};
  }
  const Tensor xb = as(x, bf16), Bb = as(B, bf16), Cb = as(C, bf16);
  const OptTensor Af = present(A) ? OptTensor(as(*A, f32)) : std::nullopt;
  const OptTensor Df = has_d ? OptTensor(as(*D, f32)) : std::nullopt;
  const OptTensor h0 = has_h0 ? OptTensor(as(*initial_state, f32)) : std::nullopt;
  const Tensor dtt = dt_by_head(dt);
  const int64_t l_pad = dtt.size(2);
  const bool y_bf16 = x.scalar_type() == bf16;  // else fp32, cast to x's dtype below
  Tensor y = new_empty(x, Sizes{b, l, nh, p}, y_bf16 ? bf16 : f32);
  Tensor h_final = new_empty(x, Sizes{b, nh, p, n}, f32);
  // a sequence split into segments (few tasks for the SMs) needs each segment's state and decay
  const int segments = tk_ssd::scan_segments(int(b), int(l), int(nh), int(ng), int(p));
  const bool split = segments > 1;
  Tensor seg_states = new_empty(x, split ? Sizes{b, nh, segments, p, n} : Sizes{0}, f32);
  Tensor seg_decay = new_empty(x, split ? Sizes{b, nh, segments} : Sizes{0}, f32);
  tk_ssd::Args a{};
  a.x = xb.data_ptr(), a.dt = data<float>(dtt), a.A = Af ? data<float>(*Af) : nullptr;
  a.B = Bb.data_ptr(), a.C = Cb.data_ptr();
  a.D = has_d ? data<float>(*Df) : nullptr;
  a.h0 = has_h0 ? data<float>(*h0) : nullptr;
  a.y = y.data_ptr(), a.y_bf16 = y_bf16, a.y_scale = float(y_scale), a.h_final = data<float>(h_final);
  a.b = int(b), a.l = int(l), a.l_pad = int(l_pad), a.nh = int(nh), a.ng = int(ng), a.p = int(p), a.n = int(n);
  a.segments = segments;
  a.seg_states = split ? data<float>(seg_states) : nullptr;
  a.seg_decay = split ? data<float>(seg_decay) : nullptr;
  const char* err = tk_ssd::launch(a, binding::current_stream(x));
  STD_TORCH_CHECK(err == nullptr, "tk_ssd::launch: ", err ? err : "");
  return {binding::to(y, x.scalar_type()), h_final};
}

std::tuple<Tensor, Tensor> ssd(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                               const OptTensor& D, const OptTensor& initial_state,
                               int64_t chunk_size) {
  (void)chunk_size;  // the result does not depend on it; the kernel uses chunks of 64
  check_inputs("tk_cuda::ssd", x, dt, A, B, C, D, initial_state);
  return scan(x, dt, A, B, C, D, initial_state, 1.0);
}

// What the backward kernels give (ssd.h), with da: dlam summed from the back inside each 64-token chunk plus the
// chunk's anchor ⟨∂L/∂h, h⟩ at its end (the later chunks' exact share; ssd/README.md, "Backward"). xdX (Σ_p x·dX) only
// with A. All fp32 but dx (bf16).
struct ScanGrads {
  Tensor dx, dB, dC, da, xdX, dD, dh0;
};
ScanGrads scan_backward(const Tensor& grad_y, const Tensor& grad_state, const Tensor& x, const Tensor& dt,
                        const OptTensor& A, const Tensor& B, const Tensor& C, const OptTensor& D,
                        const OptTensor& initial_state) {
  const int64_t b = x.size(0), l = x.size(1), nh = x.size(2), p = x.size(3), ng = B.size(2), n = B.size(3);
  const bool has_d = present(D), has_h0 = present(initial_state), has_a = present(A);
  const binding::DeviceGuard guard(x.get_device_index());
  const ScalarType f32 = ScalarType::Float, bf16 = ScalarType::BFloat16;
  const Tensor dh = as(grad_state, f32);
  // what an empty sequence gives (the kernels write dx and dh0); the rest: heads and head-dim tiles add into them
  constexpr int64_t chunk = 64;  // the kernels' (ssd.cuh CHUNK)
  const int64_t chunks = (l + chunk - 1) / chunk;
  ScanGrads r;
  r.dx = new_empty(x, Sizes{b, l, nh, p}, bf16);
  r.dB = new_zeros(x, Sizes{b, l, ng, n}, f32), r.dC = new_zeros(x, Sizes{b, l, ng, n}, f32);
  Tensor dlam = new_zeros(x, Sizes{b, l, nh}, f32);
  r.xdX = new_zeros(x, has_a ? Sizes{b, l, nh} : Sizes{0}, f32);
  r.dD = new_zeros(x, Sizes{nh}, f32);
  r.dh0 = torch::stable::clone(dh);
  Tensor anchor = new_zeros(x, Sizes{b, nh, chunks}, f32);
  if (l > 0 && b > 0 && nh > 0) {
    const Tensor xb = as(x, bf16), dyb = as(grad_y, bf16), Bb = as(B, bf16), Cb = as(C, bf16);
    const OptTensor Af = has_a ? OptTensor(as(*A, f32)) : std::nullopt;
    const OptTensor h0 = has_h0 ? OptTensor(as(*initial_state, f32)) : std::nullopt;
    const OptTensor Df = has_d ? OptTensor(as(*D, f32)) : std::nullopt;
    const Tensor dtt = dt_by_head(dt);
    tk_ssd::BwdArgs a{};
    a.x = xb.data_ptr(), a.dy = dyb.data_ptr(), a.dt = data<float>(dtt), a.A = has_a ? data<float>(*Af) : nullptr;
    a.B = Bb.data_ptr(), a.C = Cb.data_ptr(), a.h0 = has_h0 ? data<float>(*h0) : nullptr;
    a.D = has_d ? data<float>(*Df) : nullptr, a.dh = data<float>(dh), a.dx = r.dx.data_ptr();
    a.dB = data<float>(r.dB), a.dC = data<float>(r.dC), a.dlam = data<float>(dlam);
    a.xdX = has_a ? data<float>(r.xdX) : nullptr, a.dD = has_d ? data<float>(r.dD) : nullptr;
    a.dh0 = data<float>(r.dh0), a.anchor = data<float>(anchor);
    Tensor chunk_states = new_empty(x, Sizes{b * nh * p * chunks * n}, bf16);
    a.chunk_states = chunk_states.data_ptr();
    const int segments = tk_ssd::scan_segments(int(b), int(l), int(nh), int(ng), int(p));
    const bool split = segments > 1;
    Tensor seg_states = new_empty(x, split ? Sizes{b, nh, segments, p, n} : Sizes{0}, f32);
    Tensor seg_grads = new_empty(x, split ? Sizes{b, nh, segments, p, n} : Sizes{0}, f32);
    Tensor seg_decay = new_empty(x, split ? Sizes{b, nh, segments} : Sizes{0}, f32);
    a.segments = segments;
    a.seg_states = split ? data<float>(seg_states) : nullptr;
    a.seg_grads = split ? data<float>(seg_grads) : nullptr;
    a.seg_decay = split ? data<float>(seg_decay) : nullptr;
    a.b = int(b), a.l = int(l), a.l_pad = int(dtt.size(2)), a.nh = int(nh), a.ng = int(ng), a.p = int(p), a.n = int(n);
    const char* err = tk_ssd::launch_backward(a, binding::current_stream(x));
    STD_TORCH_CHECK(err == nullptr, "tk_ssd::launch_backward: ", err ? err : "");
  }
  Tensor padded = new_zeros(x, Sizes{b, chunks * chunk, nh}, f32);
  Tensor inner = torch::stable::narrow(padded, 1, 0, l);
  torch::stable::copy_(inner, dlam);
  // (the anchors also fix each chunk's own sum, anchor_{c-1} − anchor_c, but g's bf16 roundings make them no more
  // accurate than that sum: pinning the sums to them was worse in emulation, 3x worse at 64 tokens on the H200)
  const auto flip = [](const Tensor& t) { return call("aten::flip", "", t, Sizes{2}); };
  const Tensor back = flip(call("aten::cumsum", "", flip(torch::stable::view(padded, Sizes{b, chunks, chunk, nh})),
                                int64_t{2}, std::optional<ScalarType>()));
  const Tensor anchors = torch::stable::unsqueeze(call("aten::permute", "", anchor, Sizes{0, 2, 1}), 2);
  Tensor da_padded = torch::stable::view(add(back, anchors), Sizes{b, chunks * chunk, nh});
  r.da = torch::stable::narrow(da_padded, 1, 0, l);
  return r;
}

// (dx, ddt, dA, dB, dC, dD, dinitial_state), the op's schema and dtypes: ddt = Σ_p x·dX + A·da, dA = Σ dt·da.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ssd_backward(
    const Tensor& grad_y, const Tensor& grad_state, const Tensor& x, const Tensor& dt, const Tensor& A,
    const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& initial_state,
    int64_t chunk_size) {
  (void)chunk_size;
  const char* op = "tk_cuda::ssd_backward";
  check_inputs(op, x, dt, A, B, C, D, initial_state);
  const int64_t b = x.size(0), nh = x.size(2), p = x.size(3), n = B.size(3);
  STD_TORCH_CHECK(grad_y.is_cuda() && grad_state.is_cuda() && binding::same_sizes(grad_y, x) &&
                      grad_state.dim() == 4 && grad_state.size(0) == b && grad_state.size(1) == nh &&
                      grad_state.size(2) == p && grad_state.size(3) == n,
              op, ": grad_y must be (b, l, nh, p) and grad_state (b, nh, p, n), on CUDA");
  const ScanGrads r = scan_backward(grad_y, grad_state, x, dt, A, B, C, D, initial_state);
  const ScalarType f32 = ScalarType::Float;
  const Tensor Af = as(A, f32), dtf = as(dt, f32);
  const Tensor ddt = add(r.xdX, call("aten::mul", "Tensor", Af, r.da));
  const Tensor dA = torch::stable::sum(call("aten::mul", "Tensor", dtf, r.da), Sizes{0, 1});
  // absent gradients: empty, in x's dtype (as the op's fake)
  const Tensor dD = present(D) ? binding::to(r.dD, D->scalar_type()) : new_empty(x, Sizes{0});
  const Tensor dinit = present(initial_state) ? binding::to(r.dh0, initial_state->scalar_type()) : new_empty(x, Sizes{0});
  return {binding::to(r.dx, x.scalar_type()), binding::to(ddt, dt.scalar_type()), binding::to(dA, A.scalar_type()),
          binding::to(r.dB, B.scalar_type()), binding::to(r.dC, C.scalar_type()), dD, dinit};
}

// Simple GLA (tk_inductor/ops/simple_gla.py) is the scan without A: q = C, k = B (one group per head), v = x, g = dt,
// o = scale·(the scan's y). Its states are (b, h, dk, dv), the scan's transposed.
void check_gla(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
               const OptTensor& initial_state) {
  STD_TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && g.is_cuda(), op, ": inputs must be CUDA tensors");
  STD_TORCH_CHECK(q.dim() == 4 && binding::same_sizes(k, q) && v.dim() == 4 && g.dim() == 3, op,
                  ": q and k (b, l, h, dk), v (b, l, h, dv), g (b, l, h)");
  const int64_t b = q.size(0), l = q.size(1), h = q.size(2), dk = q.size(3), dv = v.size(3);
  STD_TORCH_CHECK(v.size(0) == b && v.size(1) == l && v.size(2) == h && g.size(0) == b && g.size(1) == l &&
                      g.size(2) == h, op, ": shapes disagree");
  STD_TORCH_CHECK(tk_ssd::state_size_supported(int(dk)), op, ": the kernel takes dk 16, 32, 64 or 128, got ", dk);
  STD_TORCH_CHECK(dv % tk_ssd::P_TILE == 0 && dv > 0, op, ": the kernel takes dv a multiple of ", tk_ssd::P_TILE,
                  ", got ", dv);
  if (present(initial_state))
    STD_TORCH_CHECK(initial_state->dim() == 4 && initial_state->size(0) == b && initial_state->size(1) == h &&
                        initial_state->size(2) == dk && initial_state->size(3) == dv,
                    op, ": initial_state must be (b, h, dk, dv)");
  STD_TORCH_CHECK(b * h * (dv / tk_ssd::P_TILE) <= 0x7fffffff && l <= 0x7fffffff, op, ": too large");
}
// A (b, h, dk, dv) state as the scan's (b, h, dv, dk) fp32, and back.
OptTensor scan_state(const OptTensor& s) {
  return present(s) ? OptTensor(as(torch::stable::transpose(*s, 2, 3), ScalarType::Float)) : std::nullopt;
}
Tensor gla_state(const Tensor& s, ScalarType dtype) {
  return binding::dense(binding::to(torch::stable::transpose(s, 2, 3), dtype));
}

std::tuple<Tensor, Tensor> simple_gla(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, double scale,
                                      const OptTensor& initial_state) {
  check_gla("tk_cuda::simple_gla", q, k, v, g, initial_state);
  auto [o, state] = scan(v, g, std::nullopt, k, q, std::nullopt, scan_state(initial_state), scale);
  return {o, gla_state(state, ScalarType::Float)};
}

// (dq, dk, dv, dg, dinitial_state): the scan's backward with dy = scale·grad_o (the final state does not see scale).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> simple_gla_backward(
    const Tensor& grad_o, const Tensor& grad_state, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
    double scale, const OptTensor& initial_state) {
  const char* op = "tk_cuda::simple_gla_backward";
  check_gla(op, q, k, v, g, initial_state);
  STD_TORCH_CHECK(grad_o.is_cuda() && grad_state.is_cuda() && binding::same_sizes(grad_o, v) &&
                      grad_state.dim() == 4 && grad_state.size(0) == q.size(0) && grad_state.size(1) == q.size(2) &&
                      grad_state.size(2) == q.size(3) && grad_state.size(3) == v.size(3),
                  op, ": grad_o must be (b, l, h, dv) and grad_state (b, h, dk, dv), on CUDA");
  const binding::DeviceGuard guard(q.get_device_index());
  Tensor dy = grad_o;
  if (scale != 1.0) {
    Tensor s = new_empty(grad_o, Sizes{}, ScalarType::Float);
    torch::stable::fill_(s, scale);
    dy = call("aten::mul", "Tensor", grad_o, s);
  }
  const ScanGrads r = scan_backward(dy, *scan_state(grad_state), v, g, std::nullopt, k, q, std::nullopt,
                                    scan_state(initial_state));
  const Tensor dinit = present(initial_state) ? gla_state(r.dh0, initial_state->scalar_type()) : new_empty(q, Sizes{0});
  return {binding::to(r.dC, q.scalar_type()), binding::to(r.dB, k.scalar_type()), binding::to(r.dx, v.scalar_type()),
          binding::to(r.da, g.scalar_type()), dinit};
}

// The segments per sequence tk_cuda::ssd and tk_cuda::ssd_backward split each scan into on the current device
// (1: none).
int64_t ssd_segments(int64_t b, int64_t l, int64_t nh, int64_t ng, int64_t p) {
  return tk_ssd::scan_segments(int(b), int(l), int(nh), int(ng), int(p));
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(tk_cuda, m) {
  m.def("ssd_segments(int b, int l, int nh, int ng, int p) -> int");
  m.def("ssd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D=None, Tensor? initial_state=None, "
        "int chunk_size=64) -> (Tensor, Tensor)");
  m.def("ssd_backward(Tensor grad_y, Tensor grad_state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
        "Tensor? D, Tensor? initial_state, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("simple_gla(Tensor q, Tensor k, Tensor v, Tensor g, float scale, Tensor? initial_state=None) -> (Tensor, Tensor)");
  m.def("simple_gla_backward(Tensor grad_o, Tensor grad_state, Tensor q, Tensor k, Tensor v, Tensor g, float scale, "
        "Tensor? initial_state) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(tk_cuda, CUDA, m) {
  m.impl("ssd", TORCH_BOX(&ssd));
  m.impl("ssd_backward", TORCH_BOX(&ssd_backward));
  m.impl("simple_gla", TORCH_BOX(&simple_gla));
  m.impl("simple_gla_backward", TORCH_BOX(&simple_gla_backward));
}

// ssd_segments takes no tensor, so no backend key dispatches it: it is registered for every one.
STABLE_TORCH_LIBRARY_IMPL(tk_cuda, CompositeImplicitAutograd, m) {
  m.impl("ssd_segments", TORCH_BOX(&ssd_segments));
}
