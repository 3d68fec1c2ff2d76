"""Simple GLA on the SSD kernels (csrc/kernels/ssd without A) against the fp32 chunked reference, through the raw ops
tk_cuda::simple_gla and tk_cuda::simple_gla_backward and through tk::simple_gla's autograd: odd lengths (chunk
tails), key dims 16 to 128, value dims 64 to 256 (one to four 64-wide tiles, so tasks pair tiles of one head or leave
a warpgroup idle), grids shorter than the SMs (split sequences) and longer (persistent blocks), initial and final
states, scales, bf16/fp16/fp32 inputs; key dims above 128 and value dims padded to 64, run in parts through the op."""
from __future__ import annotations

import pytest
import torch

from tk_inductor.ops import simple_gla as gla_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 2e-2  # relative (norm-wise) error vs fp32: bf16 operands on the tensor cores
BWD_TOL = 3e-2


@pytest.fixture(scope="module")
def ops():
    from tk_inductor import build

    build.load("ssd")
    return torch.ops.tk_cuda


def inputs(b, l, h, dk, dv, dtype=torch.bfloat16, h0=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, l, h, dk, device="cuda", generator=g)
    k = torch.randn(b, l, h, dk, device="cuda", generator=g) / dk**0.5
    v = torch.randn(b, l, h, dv, device="cuda", generator=g)
    gate = torch.nn.functional.logsigmoid(torch.randn(b, l, h, device="cuda", generator=g) + 2.0)
    state = torch.randn(b, h, dk, dv, device="cuda", generator=g) if h0 else None
    return q.to(dtype), k.to(dtype), v.to(dtype), gate.to(dtype), state


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)).item()


def check(ops, q, k, v, g, h0, scale=0.125):
    o, state = ops.simple_gla(q, k, v, g, scale, h0)
    torch.cuda.synchronize()
    b, l, h, dk = q.shape
    assert o.shape == v.shape and o.dtype == v.dtype and o.is_contiguous()
    assert state.shape == (b, h, dk, v.shape[-1]) and state.dtype == torch.float32 and state.is_contiguous()
    assert not o.isnan().any() and not state.isnan().any(), "unwritten or non-finite outputs"
    want_o, want_state = gla_ops.simple_gla_reference(q.float(), k.float(), v.float(), g.float(), scale, h0)
    assert rel_err(o, want_o) < TOL, f"o: relative error {rel_err(o, want_o):.3g}"
    assert rel_err(state, want_state) < TOL, f"final state: relative error {rel_err(state, want_state):.3g}"


def test_reference_is_the_recurrence():
    q, k, v, g, h0 = inputs(2, 150, 3, 32, 64, dtype=torch.float32, h0=True)
    o, s = gla_ops.simple_gla_reference(q, k, v, g, 0.3, h0)
    o2, s2 = gla_ops.simple_gla_recurrence(q, k, v, g, 0.3, h0)
    assert rel_err(o, o2) < 1e-5 and rel_err(s, s2) < 1e-5


@pytest.mark.parametrize("dk", [16, 32, 64, 128])
@pytest.mark.parametrize("l", [1, 17, 64, 65, 300, 2048])
def test_simple_gla_forward(ops, l, dk):
    check(ops, *inputs(2, l, 4, dk, 128, seed=l + dk))


@pytest.mark.parametrize("dv", [64, 128, 192, 256])
@pytest.mark.parametrize("h0", [False, True])
def test_simple_gla_forward_value_dims(ops, dv, h0):
    check(ops, *inputs(2, 333, 3, 128, dv, h0=h0, seed=dv), scale=1.0)


@pytest.mark.parametrize("b,h", [(1, 2), (3, 100)], ids=["split", "persistent"])
def test_simple_gla_forward_grids(ops, b, h):
    if b == 1:
        assert ops.ssd_segments(b, 2373, h, h, 128) > 1, "expected a split sequence"
    check(ops, *inputs(b, 2373, h, 128, 128, h0=True, seed=b))


def test_simple_gla_forward_dtypes(ops):
    for dtype in (torch.float16, torch.float32):
        check(ops, *inputs(2, 129, 2, 64, 64, dtype=dtype, h0=True, seed=11))


def test_simple_gla_bad_shapes(ops):
    q, k, v, g, _ = inputs(1, 8, 2, 48, 64)
    with pytest.raises(RuntimeError, match="dk"):
        ops.simple_gla(q, k, v, g, 1.0, None)
    q, k, v, g, _ = inputs(1, 8, 2, 64, 48)
    with pytest.raises(RuntimeError, match="dv"):
        ops.simple_gla(q, k, v, g, 1.0, None)
    q, k, v, g, h0 = inputs(1, 0, 2, 64, 64, h0=True)
    o, state = ops.simple_gla(q, k, v, g, 1.0, h0)
    assert o.shape == v.shape and torch.equal(state, h0)


def check_backward(ops, q, k, v, g, h0, scale=0.125, grad_state=True, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, l, h, dk = q.shape
    do = torch.randn(v.shape, device="cuda", generator=gen).to(v.dtype)
    dS = torch.randn(b, h, dk, v.shape[-1], device="cuda", generator=gen) if grad_state else \
        torch.zeros(b, h, dk, v.shape[-1], device="cuda")
    got = ops.simple_gla_backward(do, dS, q, k, v, g, scale, h0)
    torch.cuda.synchronize()
    leaves = [None if t is None else t.detach().float().requires_grad_() for t in (q, k, v, g, h0)]
    o, state = gla_ops.simple_gla_reference(*leaves[:4], scale, leaves[4])
    ((o * do.float()).sum() + (state * dS).sum()).backward()
    for name, t, gv, leaf in zip(("dq", "dk", "dv", "dg", "dinitial_state"), (q, k, v, g, h0), got, leaves):
        if t is None:
            assert gv.numel() == 0, name
            continue
        assert gv.shape == t.shape and gv.dtype == t.dtype, name
        assert not gv.isnan().any(), f"{name}: non-finite"
        err = rel_err(gv, leaf.grad)
        assert err < BWD_TOL, f"{name}: relative error {err:.3g} (l{l} dk{dk} dv{v.shape[-1]})"


@pytest.mark.parametrize("dk", [16, 32, 64, 128])
@pytest.mark.parametrize("l", [1, 17, 65, 300])
def test_simple_gla_backward(ops, l, dk):
    check_backward(ops, *inputs(2, l, 4, dk, 128, h0=True, seed=l + dk), seed=l)


@pytest.mark.parametrize("dv", [64, 192])
@pytest.mark.parametrize("h0,grad_state", [(False, False), (True, True)], ids=["plain", "h0+dstate"])
def test_simple_gla_backward_options(ops, dv, h0, grad_state):
    check_backward(ops, *inputs(2, 200, 3, 64, dv, h0=h0, seed=dv), scale=1.0, grad_state=grad_state)


@pytest.mark.parametrize("b,h", [(1, 2), (3, 100)], ids=["split", "persistent"])
def test_simple_gla_backward_grids(ops, b, h):
    check_backward(ops, *inputs(b, 2373, h, 128, 128, h0=True, seed=b), seed=b)


@pytest.mark.parametrize("dk,dv", [(256, 64), (256, 128), (512, 64), (96, 96), (128, 32)])
@pytest.mark.parametrize("l", [65, 1000])
def test_simple_gla_state_in_parts(ops, monkeypatch, l, dk, dv):
    """tk::simple_gla and its backward at key dims above 128 (FLA's layers use 256 and more) and value dims that are
    not multiples of 64: the kernels run on blocks of the key dims and a zero-padded value dim
    (ops/_state_parts.py)."""
    from kernel_checks import record_raw_calls

    calls = record_raw_calls(monkeypatch)
    q, k, v, g, h0 = inputs(2, l, 3, dk, dv, h0=True, seed=l + dk + dv)
    check(torch.ops.tk, q, k, v, g, h0)
    check_backward(torch.ops.tk, q, k, v, g, h0, seed=l)
    parts = len(gla_ops._state_parts.blocks(dk))
    assert calls == ["simple_gla"] * parts + ["simple_gla_backward"] * parts


def test_simple_gla_backward_through_the_op(ops):
    q, k, v, g, h0 = inputs(2, 150, 4, 128, 128, h0=True, seed=10)
    leaves = [t.requires_grad_() for t in (q, k, v, g, h0)]
    o, state = torch.ops.tk.simple_gla(q, k, v, g, 0.088, h0)
    (o.float().square().sum() + state.sum()).backward()
    want = [t.detach().float().requires_grad_() for t in (q, k, v, g, h0)]
    o32, s32 = gla_ops.simple_gla_reference(*want[:4], 0.088, want[4])
    (o32.square().sum() + s32.sum()).backward()
    for got, w in zip(leaves, want):
        assert rel_err(got.grad, w.grad) < 5e-2
