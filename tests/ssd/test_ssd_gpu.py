"""The SSD forward kernel (csrc/kernels/ssd/ssd.cu) against the fp32 chunked reference, through the raw op
tk_cuda::ssd, on random inputs: odd lengths (chunk tails), one and many chunks, state sizes 16, 32, 64 and 128, head dims
64 and 128 (one and two head-dim tiles), grouped B/C, with and without D and an initial state, bf16 and fp32 x,
and HF Mamba2's layout (sequence axis innermost); the backward kernel the same way; other state sizes and head dims
through tk::ssd, which runs them in parts. Outputs are poisoned before each call."""
from __future__ import annotations

import pytest
import torch

from tk_inductor.ops import ssd as ssd_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 2e-2  # relative (norm-wise) error vs fp32: bf16 operands on the tensor cores


@pytest.fixture(scope="module")
def ops():
    from tk_inductor import build

    build.load("ssd")
    return torch.ops.tk_cuda


def inputs(b, l, nh, ng, p, n, dtype=torch.bfloat16, D=True, h0=False, layout="bl", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, l, nh, p, device="cuda", generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, l, nh, device="cuda", generator=g) - 1.0)
    A = -torch.rand(nh, device="cuda", generator=g) * 2 - 0.05
    B = torch.randn(b, l, ng, n, device="cuda", generator=g) / n**0.5
    C = torch.randn(b, l, ng, n, device="cuda", generator=g)
    Dv = torch.randn(nh, device="cuda", generator=g) if D else None
    state = torch.randn(b, nh, p, n, device="cuda", generator=g) if h0 else None
    if layout == "channels":  # HF Mamba2: x, B, C views of (b, channels, l) buffers (conv1d output)
        x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        B = B.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        C = C.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    return x.to(dtype), dt.to(dtype), A, B.to(dtype), C.to(dtype), Dv, state


def grid(kind: str) -> tuple[int, int, int]:
    """(b, nh, ng) for the kernels' tasks (ssd.cuh: a task is two heads of a group by 64 head dims, one block per SM
    walking the tasks): "pairs" fewer tasks than SMs, "short" an odd number of heads per group (the last task of each
    group has one head), "persistent" more tasks than SMs (blocks take several tasks)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {"pairs": (2, 4, 2), "short": (1, 6, 2), "persistent": (2, sms + 2, 1)}[kind]


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)).item()


def check(ops, x, dt, A, B, C, D, h0):
    b, l, nh, p = x.shape
    junk = [torch.full((b, l, nh, p), float("nan"), device="cuda"), torch.full(x.shape, float("nan"), dtype=x.dtype,
                                                                                 device="cuda")]
    del junk
    y, state = ops.ssd(x, dt, A, B, C, D, h0, 64)
    torch.cuda.synchronize()
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert state.shape == (b, nh, p, B.shape[-1]) and state.dtype == torch.float32
    assert not y.isnan().any() and not state.isnan().any(), "unwritten or non-finite outputs"
    want_y, want_state = ssd_ops.ssd_reference(x.float(), dt.float(), A, B.float(), C.float(), D, h0, 64)
    assert rel_err(y, want_y) < TOL, f"y: relative error {rel_err(y, want_y):.3g}"
    assert rel_err(state, want_state) < TOL, f"final state: relative error {rel_err(state, want_state):.3g}"


@pytest.mark.parametrize("kind", ["pairs", "short", "persistent"])
@pytest.mark.parametrize("n", [16, 32, 64, 128])
@pytest.mark.parametrize("l", [1, 17, 64, 65, 300, 2048])
def test_ssd_forward(ops, l, n, kind):
    b, nh, ng = grid(kind)
    check(ops, *inputs(b, l, nh, ng, 64, n, seed=l + n))


@pytest.mark.parametrize("kind", ["pairs", "short"])
@pytest.mark.parametrize("D,h0", [(False, False), (True, True), (False, True)], ids=["plain", "D+h0", "h0"])
@pytest.mark.parametrize("p", [64, 128])
def test_ssd_forward_options(ops, p, D, h0, kind):
    b, nh, ng = grid(kind)
    check(ops, *inputs(b, 200, nh, ng, p, 128, D=D, h0=h0, seed=p))


def test_ssd_forward_fp16_and_fp32(ops):
    """y comes back in x's dtype: the kernel writes bf16 for bf16 x and fp32 otherwise."""
    for dtype in (torch.float16, torch.float32):
        check(ops, *inputs(2, 129, 6, 2, 64, 64, dtype=dtype, h0=True, seed=11))


def test_ssd_forward_fp32_hf_layout(ops):
    """HF Mamba2's torch path in bf16 hands over fp32 x and B/C with the sequence axis innermost."""
    x, dt, A, B, C, D, h0 = inputs(1, 333, 8, 1, 64, 128, layout="channels", seed=3)
    assert x.stride(1) == 1
    check(ops, x.float(), dt, A, B, C, D.to(torch.bfloat16), h0)


@pytest.mark.parametrize("b", [2, 3, 9])  # 32 to 144 tasks
def test_ssd_forward_many_blocks(ops, b):
    """Mamba2-370M's head shape (nh 32, p 64, n 128, ng 1)."""
    check(ops, *inputs(b, 1024, 32, 1, 64, 128, seed=4 + b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D,h0", [(True, True), (False, False)], ids=["D+h0", "plain"])
@pytest.mark.parametrize("n,p", [(16, 64), (32, 128), (64, 64), (128, 128)])
@pytest.mark.parametrize("kind", ["single", "short"])
@pytest.mark.parametrize("l", [1000, 2373])
def test_ssd_forward_split(ops, l, kind, n, p, D, h0, dtype):
    """Few tasks for the SMs: the forward splits each sequence into segments of chunks (a first pass gives each
    segment's state from zero and its decay; each segment's scan starts from the state carried across the segments
    before it). 1000 tokens: 16 chunks in segments of 4; 2373: 38 chunks, a short last segment (on 132 SMs)."""
    b, nh, ng = {"single": (1, 2, 1), "short": (1, 6, 2)}[kind]
    assert ops.ssd_segments(b, l, nh, ng, p) > 1, "expected a split sequence"
    check(ops, *inputs(b, l, nh, ng, p, n, dtype=dtype, D=D, h0=h0, seed=l + n))


def test_ssd_segments_only_split_short_grids(ops):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert ops.ssd_segments(16, 4096, 80, 1, 64) == 1  # 640 tasks: whole waves
    assert ops.ssd_segments(1, 200, 2, 1, 64) == 1  # 4 chunks: too short to split
    assert 1 < ops.ssd_segments(1, 4096, 32, 1, 64) <= 16  # 16 tasks
    assert 16 * ops.ssd_segments(1, 4096, 32, 1, 64) <= 2 * sms


def test_ssd_forward_empty_and_bad_shapes(ops):
    x, dt, A, B, C, D, h0 = inputs(1, 0, 2, 1, 64, 64, h0=True)
    y, state = ops.ssd(x, dt, A, B, C, D, h0, 64)
    assert y.shape == x.shape and torch.equal(state, h0)
    x, dt, A, B, C, D, _ = inputs(1, 8, 2, 1, 64, 48)
    with pytest.raises(RuntimeError, match="state size"):
        ops.ssd(x, dt, A, B, C, D, None, 64)
    x, dt, A, B, C, D, _ = inputs(1, 8, 2, 1, 48, 64)
    with pytest.raises(RuntimeError, match="head dims"):
        ops.ssd(x, dt, A, B, C, D, None, 64)


# ---------------------------------------------------------------------------- backward (tk_cuda::ssd_backward)

BWD_TOL = 3e-2  # relative (norm-wise) error of each gradient vs the fp32 reference's autograd (bf16 operands)
DA_TOL = BWD_TOL  # A's gradient, the same bound at the scale of its terms (da_error); |dA| itself is ~7x smaller


def check_backward(ops, x, dt, A, B, C, D, h0, grad_state=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, l, nh, p = x.shape
    dy = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    dh = torch.randn(b, nh, p, B.shape[-1], device="cuda", generator=g) if grad_state else \
        torch.zeros(b, nh, p, B.shape[-1], device="cuda")
    got = ops.ssd_backward(dy, dh, x, dt, A, B, C, D, h0, 64)
    torch.cuda.synchronize()
    inputs = (x, dt, A, B, C, D, h0)
    leaves = [None if t is None else t.detach().float().requires_grad_() for t in inputs]
    y, state = ssd_ops.ssd_reference(*leaves, 64)
    ((y * dy.float()).sum() + (state * dh).sum()).backward()
    names = ("dx", "ddt", "dA", "dB", "dC", "dD", "dinitial_state")
    for name, t, gv, leaf in zip(names, inputs, got, leaves):
        if t is None:
            assert gv.numel() == 0, name
            continue
        assert gv.shape == t.shape and gv.dtype == t.dtype, name
        assert not gv.isnan().any(), f"{name}: non-finite"
        err, tol = (rel_err(gv, leaf.grad), BWD_TOL) if name != "dA" else (da_error(gv, leaves, dy), DA_TOL)
        assert err < tol, f"{name}: relative error {err:.3g} (l{l} n{B.shape[-1]} p{p})"


def da_error(dA, leaves, dy):
    """A's gradient is Σ over every (batch, token) of dt·da (da: the gradient of a = dt·A), terms of both signs that
    cancel to a small fraction of their magnitudes, so its error is measured against Σ |dt·da| per head, the scale
    its bf16 terms are rounded at. da comes from the reference's own gradients: ddt = Σ_p x·dX + A·da with
    dx = dt·dX + D·dy."""
    x, dt, A, _, _, D, _ = (None if t is None else t.detach() for t in leaves)
    dyf = dy.float()
    grads = [None if t is None else t.grad for t in leaves]
    dX = (grads[0] - (0 if D is None else D.view(1, 1, -1, 1) * dyf)) / dt.unsqueeze(-1)
    da = (grads[1] - (x * dX).sum(-1)) / A
    scale = (dt * da).abs().sum((0, 1))
    return ((dA.float() - grads[2]).norm() / scale.norm().clamp_min(1e-6)).item()


@pytest.mark.parametrize("kind", ["pairs", "short", "persistent"])
@pytest.mark.parametrize("n", [16, 32, 64, 128])
@pytest.mark.parametrize("l", [1, 17, 64, 65, 300])
def test_ssd_backward(ops, l, n, kind):
    b, nh, ng = grid(kind)
    check_backward(ops, *inputs(b, l, nh, ng, 64, n, h0=True, seed=l + n), seed=l)


@pytest.mark.parametrize("D,h0,grad_state", [(False, False, False), (True, False, True), (False, True, False)],
                         ids=["plain", "D+dstate", "h0"])
@pytest.mark.parametrize("kind", ["pairs", "short"])
def test_ssd_backward_options(ops, D, h0, grad_state, kind):
    b, nh, ng = grid(kind)
    check_backward(ops, *inputs(b, 200, nh, ng, 128, 128, D=D, h0=h0, seed=7), grad_state=grad_state)


@pytest.mark.parametrize("D,h0,grad_state", [(True, True, True), (False, False, False)], ids=["D+h0+dstate", "plain"])
@pytest.mark.parametrize("n,p", [(16, 64), (32, 128), (64, 64), (128, 128)])
@pytest.mark.parametrize("kind", ["single", "short"])
@pytest.mark.parametrize("l", [1000, 2373])
def test_ssd_backward_split(ops, l, kind, n, p, D, h0, grad_state):
    """Both backward scans split as the forward does: h's segment states for kernel A, ∂L/∂h's (last segment first)
    for kernel B; dh0 from the first segment's task."""
    b, nh, ng = {"single": (1, 2, 1), "short": (1, 6, 2)}[kind]
    assert ops.ssd_segments(b, l, nh, ng, p) > 1, "expected a split sequence"
    check_backward(ops, *inputs(b, l, nh, ng, p, n, D=D, h0=h0, seed=l + p), grad_state=grad_state, seed=l)


def test_ssd_backward_hf_layout_and_many_blocks(ops):
    x, dt, A, B, C, D, h0 = inputs(1, 333, 8, 1, 64, 128, layout="channels", seed=8)
    check_backward(ops, x.float(), dt, A, B, C, D, h0)
    check_backward(ops, *inputs(2, 1024, 32, 1, 64, 128, seed=9))


@pytest.mark.parametrize("n,p", [(256, 64), (192, 32), (48, 96), (8, 64), (256, 128)])
@pytest.mark.parametrize("l", [65, 1000])
def test_ssd_state_in_parts(ops, monkeypatch, l, n, p):
    """tk::ssd and tk::ssd_backward at state sizes and head dims the kernels do not hold: the kernels run on blocks of
    the state's columns and on a zero-padded head dim (ops/_state_parts.py), and the sum is the whole scan."""
    from kernel_checks import record_raw_calls

    calls = record_raw_calls(monkeypatch)
    x, dt, A, B, C, D, h0 = inputs(1, l, 6, 2, p, n, h0=True, seed=l + n + p)
    check(torch.ops.tk, x, dt, A, B, C, D, h0)
    check_backward(torch.ops.tk, x, dt, A, B, C, D, h0, seed=l)
    parts = len(ssd_ops._state_parts.blocks(n))
    assert calls == ["ssd"] * parts + ["ssd_backward"] * parts


def test_ssd_backward_through_the_op(ops, monkeypatch):
    """tk::ssd's autograd runs the backward kernels once BACKWARD_KERNEL_VALIDATED is set."""
    monkeypatch.setattr(ssd_ops, "BACKWARD_KERNEL_VALIDATED", True)
    x, dt, A, B, C, D, h0 = inputs(1, 150, 4, 1, 64, 64, seed=10)
    leaves = [t.requires_grad_() for t in (x, dt, B, C)]
    y, state = torch.ops.tk.ssd(x, dt, A, B, C, D, None, 64)
    (y.float().square().sum() + state.sum()).backward()
    want = [t.detach().float().requires_grad_() for t in (x, dt, B, C)]
    y32, s32 = ssd_ops.ssd_reference(want[0], want[1], A, want[2], want[3], D, None, 64)
    (y32.square().sum() + s32.sum()).backward()
    for got, w in zip(leaves, want):
        assert rel_err(got.grad, w.grad) < 5e-2

