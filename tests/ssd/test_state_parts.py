"""States the SSD kernels do not hold run as parts that they do (tk_inductor/ops/_state_parts.py), for tk::ssd and
tk::simple_gla. On the CPU the raw kernels are stood in for by their references behind the kernels' own limits (state
size 16, 32, 64 or 128, head dim a multiple of 64): the op's result and every gradient through its autograd must
equal the reference's on the whole state, and each raw call must be one the kernels take."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tk_inductor.ops import _dispatch, _state_parts
from tk_inductor.ops import simple_gla as gla_ops
from tk_inductor.ops import ssd as ssd_ops


class KernelStandIns:
    """The raw ops tk_cuda::{ssd, ssd_backward, simple_gla, simple_gla_backward} as the references, refusing what the
    kernels refuse; `calls` records (op, n, p) per raw call."""

    def __init__(self):
        self.calls = []

    def _take(self, op, n, p):
        assert n in _state_parts.STATE_SIZES and p % _state_parts.P_TILE == 0, (op, n, p)
        self.calls.append((op, n, p))

    def ssd(self, x, dt, A, B, C, D, h0, chunk):
        self._take("ssd", B.shape[-1], x.shape[-1])
        return ssd_ops.ssd_reference(x, dt, A, B, C, D, h0, chunk)

    def ssd_backward(self, gy, gs, x, dt, A, B, C, D, h0, chunk):
        self._take("ssd_backward", B.shape[-1], x.shape[-1])
        return ssd_ops._reference_grads(gy, gs, x, dt, A, B, C, D, h0, chunk)

    def simple_gla(self, q, k, v, g, scale, h0):
        self._take("simple_gla", q.shape[-1], v.shape[-1])
        return gla_ops.simple_gla_reference(q, k, v, g, scale, h0)

    def simple_gla_backward(self, go, gs, q, k, v, g, scale, h0):
        self._take("simple_gla_backward", q.shape[-1], v.shape[-1])
        return gla_ops._reference_grads(go, gs, q, k, v, g, scale, h0)


@pytest.fixture
def kernels(monkeypatch):
    stand_ins = KernelStandIns()
    monkeypatch.setattr(_dispatch, "use_kernel", lambda family, *tensors: True)
    monkeypatch.setattr(_dispatch, "has_kernel", lambda name: True)
    monkeypatch.setattr(_dispatch, "kernel", lambda name: getattr(stand_ins, name))
    return stand_ins


def test_blocks():
    assert _state_parts.blocks(128) == [(0, 128, 128)]
    assert _state_parts.blocks(48) == [(0, 48, 64)]
    assert _state_parts.blocks(8) == [(0, 8, 16)]
    assert _state_parts.blocks(256) == [(0, 128, 128), (128, 256, 128)]
    assert _state_parts.blocks(160) == [(0, 128, 128), (128, 160, 32)]
    assert _state_parts.blocks(300) == [(0, 128, 128), (128, 256, 128), (256, 300, 64)]


def test_kernel_supports():
    assert ssd_ops.kernel_supports(256, 64) is None and ssd_ops.kernel_supports(48, 32) is None
    assert ssd_ops.kernel_supports(128, 96) is None
    assert "head dim 48 (the SSD kernels take multiples of 32)" in ssd_ops.kernel_supports(128, 48)
    assert gla_ops.kernel_supports(256, 64) is None
    assert "value head dim 80" in gla_ops.kernel_supports(128, 80)


def _ssd_inputs(b, l, nh, ng, p, n, D, h0, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, nh, p, generator=g)
    dt = F.softplus(torch.randn(b, l, nh, generator=g) - 1)
    A = -torch.rand(nh, generator=g) - 0.1
    B, C = (torch.randn(b, l, ng, n, generator=g) / n ** 0.5 for _ in range(2))
    Dv = torch.randn(nh, generator=g) if D else None
    init = torch.randn(b, nh, p, n, generator=g) if h0 else None
    return [None if t is None else t.to(dtype) for t in (x, dt, A, B, C, Dv, init)]


def _grads(outs, leaves, seed=1):
    gen = torch.Generator().manual_seed(seed)
    seeds = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    return torch.autograd.grad(outs, leaves, seeds)


def _close(got, want, tol):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("n, p, parts", [(256, 64, [128, 128]), (192, 32, [128, 64]), (48, 96, [64]),
                                         (8, 64, [16]), (128, 32, [128])])
@pytest.mark.parametrize("D, h0", [(True, True), (False, False)])
def test_ssd_in_parts_equals_the_whole(kernels, n, p, parts, D, h0):
    args = _ssd_inputs(2, 37, 4, 2, p, n, D, h0, torch.float32)
    leaves = [t.requires_grad_() for t in args if t is not None]
    got = torch.ops.tk.ssd(*args, 16)
    want_args = [None if t is None else t.detach().clone().requires_grad_() for t in args]
    want = ssd_ops.ssd_reference(*want_args, 16)
    _close(got, want, 1e-5)
    _close(_grads(got, leaves), _grads(want, [t for t in want_args if t is not None]), 1e-4)
    assert [n for op, n, _ in kernels.calls if op == "ssd"] == parts
    assert [n for op, n, _ in kernels.calls if op == "ssd_backward"] == parts


def test_ssd_in_parts_in_bf16(kernels):
    """bf16 outputs of the parts are added in fp32 and rounded once more: within bf16's resolution of the whole."""
    args = _ssd_inputs(1, 70, 2, 1, 32, 256, True, False, torch.bfloat16)
    y, state = torch.ops.tk.ssd(*args)
    want_y, want_state = ssd_ops.ssd_reference(*args)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(y.float(), want_y.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(state, want_state)


def test_ssd_kernel_sizes_run_whole(kernels):
    args = _ssd_inputs(1, 9, 2, 1, 128, 64, True, True, torch.float32)
    torch.ops.tk.ssd(*args)
    assert kernels.calls == [("ssd", 64, 128)]


def _gla_inputs(b, l, h, dk, dv, h0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, l, h, dk, generator=g) / dk ** 0.25 for _ in range(2))
    v = torch.randn(b, l, h, dv, generator=g)
    gate = F.logsigmoid(torch.randn(b, l, h, generator=g) + 2)
    state = torch.randn(b, h, dk, dv, generator=g) if h0 else None
    return q, k, v, gate, state


@pytest.mark.parametrize("dk, dv, parts", [(256, 64, [128, 128]), (512, 128, [128] * 4), (80, 32, [128]),
                                           (144, 96, [128, 16])])
@pytest.mark.parametrize("h0", [False, True])
def test_simple_gla_in_parts_equals_the_whole(kernels, dk, dv, parts, h0):
    q, k, v, g, s0 = _gla_inputs(2, 45, 3, dk, dv, h0)
    args = [t for t in (q, k, v, g, s0) if t is not None]
    leaves = [t.requires_grad_() for t in args]
    got = torch.ops.tk.simple_gla(q, k, v, g, 0.7, s0)
    want_leaves = [t.detach().clone().requires_grad_() for t in args]
    wq, wk, wv, wg = want_leaves[:4]
    want = gla_ops.simple_gla_reference(wq, wk, wv, wg, 0.7, want_leaves[4] if h0 else None)
    _close(got, want, 1e-5)
    _close(_grads(got, leaves), _grads(want, want_leaves), 1e-4)
    assert [n for op, n, _ in kernels.calls if op == "simple_gla"] == parts
    assert [n for op, n, _ in kernels.calls if op == "simple_gla_backward"] == parts
