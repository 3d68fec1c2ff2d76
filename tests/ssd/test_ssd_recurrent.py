"""The SSD written as its token-by-token recurrence (patterns/_ssd_recurrent.py), in reference mode on the CPU: the
spellings of the same loop are replaced by one tk::ssd and give the eager values and gradients; loops that are not
the SSD stay as they are."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tk_inductor
from tolerance import summed
from tk_inductor import config, rewrite
from tk_inductor.ops import ssd as ops

# aot_eager compiles the rest of each graph: the rewrite is what these tests check (and Inductor's C++ build of the
# unrolled loops would take most of their time)
OPTIONS = {"reference": True, "strict": False, "inner": "aot_eager"}


class RecurrentSSD(nn.Module):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t ⊗ B_t, y_t = h_t C_t (+ D x_t), one Python loop step per token. Spellings:
    "einsum" / "mul-sum" readout, tokens by "index" / "select" / "unbind", "h-first" (h * decay), "X-before" (x·dt
    before the loop), "einsum-input" (the input term as one einsum), "groups" (B/C per group, repeat_interleave'd to
    heads), "cat" (the outputs joined by cat, not stack), and flaws that make it another computation: "stale-x" (x of token 0 every step), "no-exp" (the decay
    without exp), "X-scaled" (with X-before: 2x·dt as the input), "twice-D" (D·x added twice)."""

    def __init__(self, spelling=("einsum", "index"), D=True, h0=False):
        super().__init__()
        self.spelling, self.D, self.h0 = set(spelling), D, h0

    def forward(self, x, dt, A, B, C, D, h0):
        s = self.spelling
        b, l, nh, p = x.shape
        if "groups" in s:
            B, C = (t.repeat_interleave(nh // t.shape[2], dim=2) for t in (B, C))
        X = (2 * x if "X-scaled" in s else x) * dt[..., None] if "X-before" in s else None

        def token(t, i):
            if "select" in s:
                return t.select(1, i)
            if "unbind" in s:
                return t.unbind(1)[i]
            return t[:, i]

        h = h0 if self.h0 else x.new_zeros(b, nh, p, B.shape[-1])
        ys = []
        for i in range(l):
            dti = token(dt, i)
            decay = dti * A if "no-exp" in s else torch.exp(dti * A)
            xi = token(x, 0 if "stale-x" in s else i)
            if "X-before" in s:
                inp = token(X, i)[..., None] * token(B, i)[:, :, None, :]
            elif "einsum-input" in s:
                inp = torch.einsum("bh,bhp,bhn->bhpn", dti, xi, token(B, i))
            else:
                inp = (dti[:, :, None] * xi)[..., None] * token(B, i)[:, :, None, :]
            h = (h * decay[..., None, None] if "h-first" in s else decay[..., None, None] * h) + inp
            if "mul-sum" in s:
                y = (h * token(C, i)[:, :, None, :]).sum(-1)
            else:
                y = torch.einsum("bhpn,bhn->bhp", h, token(C, i))
            if self.D:
                y = y + D[:, None] * token(x, i)
            if "twice-D" in s:
                y = y + D[:, None] * token(x, i)
            ys.append(y)
        if "cat" in s:  # each token's output given a sequence axis, joined along it
            return torch.cat([y[:, None] if i % 2 else y.unsqueeze(1) for i, y in enumerate(ys)], dim=1), h
        return torch.stack(ys, dim=1), h


def _inputs(b=2, l=10, nh=4, ng=2, p=6, n=5, dtype=torch.float32, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, nh, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, l, nh, generator=g) - 1)
    A = -torch.rand(nh, generator=g) - 0.1
    B, C = torch.randn(b, l, ng, n, generator=g), torch.randn(b, l, ng, n, generator=g)
    D, h0 = torch.randn(nh, generator=g), torch.randn(b, nh, p, n, generator=g)
    return [t.to(dtype).requires_grad_(requires_grad) for t in (x, dt, A, B, C, D, h0)]


def _compile(module, args, replaced=1):
    torch._dynamo.reset()
    tk_inductor.reset()
    out = torch.compile(module, backend="thunderkittens", options=OPTIONS, fullgraph=True)(*args)
    report = tk_inductor.report()
    assert report.replaced.get("ssd", 0) == replaced, report.kept
    return out, report


@pytest.mark.parametrize("spelling, D, h0", [
    (("einsum", "index", "groups"), True, False), (("mul-sum", "select"), False, True),
    (("einsum", "unbind", "h-first"), True, True), (("mul-sum", "index", "X-before", "groups"), True, False),
    (("einsum", "select", "einsum-input", "cat"), False, True), (("mul-sum", "unbind", "X-before"), False, False),
])
def test_recurrent_spellings_are_replaced_and_equal(spelling, D, h0):
    module = RecurrentSSD(spelling, D=D, h0=h0)
    args = _inputs(ng=2 if "groups" in spelling else 4, requires_grad=True)
    out, _ = _compile(module, args)
    want = module(*args)
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5)
    leaves = [a for a in args if a.requires_grad]
    seeds = [torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) for w in want]
    got = torch.autograd.grad(out, leaves, seeds, allow_unused=True)
    ref = torch.autograd.grad(want, leaves, seeds, allow_unused=True)
    for g, r in zip(got, ref):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r, **summed(r, args[0].numel()))


def test_the_op_gets_the_whole_tensors():
    """One tk::ssd over the sequence: x, dt, A, the group-level B and C, D and the initial state, in place of the
    unrolled steps."""
    cfg = config.current(OPTIONS)
    calls = []

    def backend(gm, example_inputs):
        rewrite.run(gm, cfg)
        calls.extend(n for n in gm.graph.nodes if n.target is torch.ops.tk.ssd.default)
        assert not any(n.target is torch.exp for n in gm.graph.nodes), "unrolled steps left in the graph"
        return gm

    torch._dynamo.reset()
    args = _inputs()
    torch.compile(RecurrentSSD(("einsum", "index", "groups"), D=True, h0=True), backend=backend)(*args)
    (call,) = calls
    assert [rewrite.example(t).shape for t in call.args[:7]] == [t.shape for t in args]


def test_the_library_recurrence_in_bf16_is_replaced_with_its_dtypes():
    """tk_inductor.ops.ssd.ssd_recurrence: upcast to fp32, per-head B/C from groups, y cast back to x's dtype."""
    args = _inputs(dtype=torch.bfloat16)
    x, dt, A, B, C, D, h0 = args
    fn = lambda x, dt, A, B, C, D, h0: ops.ssd_recurrence(x, dt, A.float(), B, C, D.float(), h0.float())  # noqa: E731
    out, _ = _compile(fn, args)
    exact = ops.ssd_recurrence(*(t.double() for t in args))
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32
    for o, e in zip(out, exact):
        assert float((o.double() - e).norm() / e.norm()) < 1e-2


@pytest.mark.parametrize("flaw", [("stale-x",), ("no-exp",), ("X-before", "X-scaled"), ("twice-D",)])
def test_loops_that_are_not_the_ssd_are_kept(flaw):
    module = RecurrentSSD(("einsum", "index") + flaw, D=True)
    args = _inputs(ng=4)
    out, _ = _compile(module, args, replaced=0)
    for o, w in zip(out, module(*args)):
        torch.testing.assert_close(o, w)


def test_a_single_step_is_left_to_inductor():
    """One token is a state update, not a scan: kept as it is (the anchor needs two tokens)."""
    module = RecurrentSSD(("einsum", "index"), D=True, h0=True)
    args = _inputs(l=1, ng=4)
    _compile(module, args, replaced=0)
