"""tk::simple_gla on the CPU: its chunked reference against the token-by-token recurrence (values, the final state,
every gradient), its input checks; and the matcher (patterns/_gated.py): the quadratic gated form in FLA's naive
spelling and others, heads-first and tokens-first, replaced and equal to eager in reference mode, forward and
gradients; near misses (an anti-causal decay, a decay over the wrong dim, an exclusive cumsum) left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynamo_tracing import rewritten
from tk_inductor.ops import simple_gla as gla_ops

OPTIONS = {"reference": True, "inner": "aot_eager"}


def _inputs(b=2, l=37, h=3, dk=8, dv=6, seed=0, h0=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, l, h, dk, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, l, h, dv, generator=g, dtype=dtype)
    gate = F.logsigmoid(torch.randn(b, l, h, generator=g, dtype=dtype) + 1)
    state = torch.randn(b, h, dk, dv, generator=g, dtype=dtype) if h0 else None
    return q, k, v, gate, state


@pytest.mark.parametrize("l", [1, 5, 64, 130])
def test_reference_is_the_recurrence(l):
    q, k, v, g, h0 = _inputs(l=l, h0=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, h0)]
    o, s = gla_ops.simple_gla_reference(*leaves[:4], 0.3, leaves[4], chunk_size=16)
    want = [t.clone().requires_grad_() for t in (q, k, v, g, h0)]
    o2, s2 = gla_ops.simple_gla_recurrence(*want[:4], 0.3, want[4])
    torch.testing.assert_close(o, o2)
    torch.testing.assert_close(s, s2)
    go, gs = torch.randn_like(o), torch.randn_like(s)
    for got, ref in zip(torch.autograd.grad((o, s), leaves, (go, gs)), torch.autograd.grad((o2, s2), want, (go, gs))):
        torch.testing.assert_close(got, ref)


def test_op_autograd_on_cpu():
    q, k, v, g, h0 = _inputs(h0=True, dtype=torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v, g, h0)]
    o, s = torch.ops.tk.simple_gla(*leaves[:4], 0.5, leaves[4])
    want = [t.detach().double().requires_grad_() for t in leaves]
    o2, s2 = gla_ops.simple_gla_recurrence(*want[:4], 0.5, want[4])
    torch.testing.assert_close(o.double(), o2, rtol=1e-4, atol=1e-4)
    (o.sum() + s.square().sum()).backward()
    (o2.sum() + s2.square().sum()).backward()
    for got, ref in zip(leaves, want):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-3, atol=1e-3)


def test_op_checks_its_inputs():
    q, k, v, g, _ = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="g must be"):
        torch.ops.tk.simple_gla(q, k, v, g[:, :-1], 1.0)
    with pytest.raises(ValueError, match="k .* must have q's shape"):
        torch.ops.tk.simple_gla(q, k[..., :-1], v, g, 1.0)
    with pytest.raises(ValueError, match="initial_state"):
        torch.ops.tk.simple_gla(q, k, v, g, 1.0, torch.zeros(2, 3, 8, 8))


# ---------------------------------------------------------------------------- the matcher

def fla_naive_parallel(q, k, v, g, scale=0.25):
    """FLA's naive_parallel_simple_gla: tokens-first inputs, heads-first math, (G_i − G_j).tril().exp().tril()."""
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    A = q @ k.transpose(-1, -2) * scale
    G = g.cumsum(-1)
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()
    return ((A * D) @ v).transpose(1, 2)


def heads_first_segsum(q, k, v, g, scale=0.25):
    """Heads-first (B, H, N, d) operands, the decay masked to -inf before the exp, einsum products."""
    N = q.shape[2]
    G = g.cumsum(-1)
    upper = torch.triu(torch.ones(N, N, dtype=torch.bool, device=q.device), diagonal=1)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(upper, float("-inf")).exp()
    scores = torch.einsum("bhnd,bhmd->bhnm", q * scale, k)
    return torch.einsum("bhnm,bhme->bhne", scores * D, v)


def tokens_first_mask_after(q, k, v, g, scale=0.25):
    """Tokens-first operands and output, exp(Δ) times a causal 0-1 mask."""
    N = q.shape[1]
    G = g.transpose(1, 2).cumsum(-1)
    causal = torch.tril(torch.ones(N, N, device=q.device))
    D = torch.exp(G[..., :, None] - G[..., None, :]) * causal
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    return torch.einsum("bhnm,bmhe->bnhe", D * scores, v)


def scale_on_the_output(q, k, v, g, scale=0.25):
    """Heads-first math on tokens-first operands, the scale applied to the output, the causal mask by where()."""
    N = q.shape[1]
    G = g.transpose(1, 2).cumsum(-1)
    causal = torch.tril(torch.ones(N, N, dtype=torch.bool, device=q.device))
    D = torch.where(causal, (G[..., :, None] - G[..., None, :]).exp(), 0.0)
    A = torch.einsum("bnhd,bmhd->bhnm", q, k)
    return torch.einsum("bhnm,bmhe->bnhe", A * D, v) * scale


def scores_masked_too(q, k, v, g, scale=0.25):
    """The scores made causal as well as decayed (redundant: the decay matrix is causal)."""
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    G = g.cumsum(-1)
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()
    return (((q @ k.transpose(-1, -2) * scale).tril() * D) @ v).transpose(1, 2)


def run(fn, *inputs):
    """(report, the op's scale arguments, compiled output) for fn compiled with the rewrite."""
    return rewritten(fn, inputs, OPTIONS, torch.ops.tk.simple_gla.default, lambda n: n.args[4])


def _heads_first(q, k, v, g):
    return [t.transpose(1, 2).detach().contiguous().requires_grad_() for t in (q, k, v, g)]


@pytest.mark.parametrize("form", ["fla_naive_parallel", "heads_first_segsum", "tokens_first_mask_after",
                                  "scale_on_the_output", "scores_masked_too"])
def test_gated_forms_are_replaced_and_equal(form):
    fn = globals()[form]
    q, k, v, g, _ = _inputs(dtype=torch.float32)
    inputs = [t.requires_grad_() for t in (q, k, v, g)]
    if form == "heads_first_segsum":
        inputs = _heads_first(*inputs)
    report, scales, out = run(fn, *inputs)
    assert report.replaced.get("linear_attention") == 1, report
    # (a scale on the output stays a multiply after the op)
    assert scales == [pytest.approx(1.0 if form == "scale_on_the_output" else 0.25)]
    want = fn(*inputs)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out)
    for got, ref in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_bf16_operands_with_an_fp32_decay():
    """bf16 q/k/v with an fp32 decay: eager's masked scores and output are fp32; the op's bf16 output is cast up."""
    q, k, v, g, _ = _inputs(dtype=torch.float32)
    q, k, v = (t.bfloat16() for t in (q, k, v))

    def fn(q, k, v, g):
        q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
        G = g.cumsum(-1)
        D = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()
        return ((q @ k.transpose(-1, -2) * D) @ v.float()).transpose(1, 2)

    report, _, out = run(fn, q, k, v, g)
    assert report.replaced.get("linear_attention") == 1, report
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fn(q, k, v, g), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("operands", ["bf16", "fp32"])
@pytest.mark.parametrize("form", ["fla_naive_parallel", "tokens_first_mask_after"])
def test_under_autocast(form, operands):
    """torch.autocast(bf16): the products run in bf16, the cumsum (and so the decay matrix) in fp32; q/k/v bf16 (from
    the model's projections) or fp32 (autocast casts them for the products); replaced, in eager's output dtype."""
    fn = globals()[form]
    q, k, v, g, _ = _inputs(dtype=torch.float32)
    if operands == "bf16":
        q, k, v = (t.bfloat16() for t in (q, k, v))
    inputs = [t.requires_grad_() for t in (q, k, v, g)]

    def amp(*a):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*a)

    report, _, out = run(amp, *inputs)
    assert report.replaced.get("linear_attention") == 1, report
    want = amp(*inputs)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)
    grad = torch.randn_like(out)
    for got, ref in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.float(), ref.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("dtype,dk,dv,kept", [(torch.bfloat16, 64, 64, None), (torch.float16, 128, 64, None),
                                              (torch.float32, 64, 64, "fp32 q/k/v"), (torch.bfloat16, 256, 64, None),
                                              (torch.bfloat16, 64, 80, "value head dim 80")])
def test_kernel_checks_on_cuda_graphs(dtype, dk, dv, kept):
    """The matcher's CUDA branch (fake CUDA example values, reference mode off): 16-bit operands are replaced, at
    key dims the kernels hold and at larger ones (run in parts); fp32 models keep their precision; a value dim the
    kernels cannot pad to theirs is kept with the reason."""
    from dynamo_tracing import to_fake_cuda
    from tk_inductor import config
    from tk_inductor.patterns import linear_attention

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    q, k, v, g, _ = _inputs(b=1, l=8, h=2, dk=dk, dv=dv, dtype=torch.float32)
    torch._dynamo.reset()
    torch.compile(fla_naive_parallel, backend=capture)(*(t.to(dtype) for t in (q, k, v, g)))
    to_fake_cuda(graphs[0].graph)
    matches = list(linear_attention.find(graphs[0].graph, config.current({"reference": False})))
    assert len(matches) == 1 and matches[0].target is torch.ops.tk.simple_gla.default
    assert (matches[0].reason is None) if kept is None else kept in matches[0].reason, matches[0].reason


def anti_causal(q, k, v, g):
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    G = g.cumsum(-1)
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).triu().exp().triu()
    return ((q @ k.transpose(-1, -2) * D) @ v).transpose(1, 2)


def wrong_dim(q, k, v, g):
    """The cumsum over the heads, the difference over the tokens (H == N here)."""
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    G = g.cumsum(1)
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()
    return ((q @ k.transpose(-1, -2) * D) @ v).transpose(1, 2)


def exclusive(q, k, v, g):
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    G = g.cumsum(-1) - g
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()
    return ((q @ k.transpose(-1, -2) * D) @ v).transpose(1, 2)


@pytest.mark.parametrize("near_miss", ["anti_causal", "wrong_dim", "exclusive"])
def test_near_misses_are_not_replaced(near_miss):
    fn = globals()[near_miss]
    q, k, v, g, _ = _inputs(b=1, l=5, h=5, dtype=torch.float32)
    report, scales, out = run(fn, q, k, v, g)
    assert not scales, report
    torch.testing.assert_close(out, fn(q, k, v, g))


def test_dynamic_lengths():
    """dynamic=True: one graph, replaced, serves every length (the scale a literal: Dynamo lifts a float argument of
    the compiled function into a run-time value)."""
    import tk_inductor

    def fn(q, k, v, g):
        return fla_naive_parallel(q, k, v, g, 0.25)

    compiled = torch.compile(fn, backend="thunderkittens", dynamic=True, options={"reference": True})
    torch._dynamo.reset()
    for l in (19, 33):
        q, k, v, g, _ = _inputs(l=l, dtype=torch.float32)
        torch.testing.assert_close(compiled(q, k, v, g), fn(q, k, v, g), rtol=1e-4, atol=1e-5)
    assert tk_inductor.report().replaced.get("linear_attention", 0) >= 1, tk_inductor.report()


def test_a_gated_model_trains_through_the_public_api():
    """torch.compile(backend="thunderkittens") in reference mode: the layer's forward and its parameters' gradients
    equal eager's (the op's autograd traced by AOTAutograd)."""
    import tk_inductor

    class Layer(torch.nn.Module):
        def __init__(self, d=16, h=2, dk=8, dv=8):
            super().__init__()
            self.h, self.dk, self.dv = h, dk, dv
            self.qk = torch.nn.Linear(d, 2 * h * dk, bias=False)
            self.v = torch.nn.Linear(d, h * dv, bias=False)
            self.gate = torch.nn.Linear(d, h)
            self.out = torch.nn.Linear(h * dv, d, bias=False)

        def forward(self, x):
            B, N, _ = x.shape
            q, k = self.qk(x).view(B, N, 2, self.h, self.dk).unbind(2)
            v = self.v(x).view(B, N, self.h, self.dv)
            g = F.logsigmoid(self.gate(x))
            return self.out(fla_naive_parallel(q, k, v, g, self.dk**-0.5).reshape(B, N, -1))

    torch.manual_seed(0)
    model = Layer()
    x = torch.randn(2, 24, 16)
    compiled = torch.compile(model, backend="thunderkittens", options={"reference": True})
    torch._dynamo.reset()
    out = compiled(x)
    assert tk_inductor.report().replaced.get("linear_attention", 0) >= 1, tk_inductor.report()
    out.square().sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = model(x)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5)
