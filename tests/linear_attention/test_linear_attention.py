"""tk::linear_attention: op semantics (vs naive formulas and FLA's definitions), opcheck, gradients,
validation, and the rewrite of every spelling in tests/models_linear.py (CPU, reference mode)."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: models_linear

import tk_inductor  # noqa: E402
from tk_inductor import config, rewrite  # noqa: E402
from tk_inductor.ops import linear_attention as la  # noqa: E402

from models_linear import LinearAttention, TinyLM  # noqa: E402

OPTIONS = {"reference": True, "inner": "aot_eager"}


def _inputs(B=2, H=3, N=37, dk=5, dv=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g, dtype=dtype) for d in (dk, dk, dv)]


def _weights(feature_map, H=3, dk=5, f=6, dtype=torch.float64):
    if feature_map != "hedgehog":
        return None, None
    g = torch.Generator().manual_seed(1)
    return torch.randn(H, dk, f, generator=g, dtype=dtype), torch.randn(dk, f, generator=g, dtype=dtype)


def _naive(q, k, v, feature_map, qw, kw, scale, normalize, eps):
    """Straight from the docstring: the N×N kernel matrix, masked, times v."""
    if feature_map == "based":
        s = scale * q @ k.transpose(-1, -2)
        kern = 1 + s + s * s / 2
    else:
        phi = {"identity": lambda x, w: x, "elu1": lambda x, w: F.elu(x) + 1,
               "hedgehog": lambda x, w: torch.cat([torch.softmax(x @ w if w.dim() == 2 else torch.einsum("bhnd,hdf->bhnf", x, w), -1),
                                                   torch.softmax(-(x @ w if w.dim() == 2 else torch.einsum("bhnd,hdf->bhnf", x, w)), -1)], -1)}[feature_map]
        kern = scale * phi(q, qw) @ phi(k, kw).transpose(-1, -2)
    kern = kern.tril()
    o = kern @ v
    return o / (kern.sum(-1, keepdim=True) + eps) if normalize else o


# ---------------------------------------------------------------------------- op semantics

@pytest.mark.parametrize("feature_map", la.FEATURE_MAPS)
@pytest.mark.parametrize("normalize", [False, True])
def test_reference_matches_naive(feature_map, normalize):
    q, k, v = _inputs(N=150)  # > 2 reference chunks, ragged tail
    if feature_map == "identity":
        q, k = q.abs(), k.abs()  # a positive kernel keeps the normaliser well conditioned
    qw, kw = _weights(feature_map)
    got = la.linear_attention_reference(q, k, v, feature_map, qw, kw, 0.3, normalize, 1e-6)
    want = _naive(q, k, v, feature_map, qw, kw, 0.3, normalize, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_based_is_fla_parallel_based_and_the_taylor_feature_map():
    """FLA parallel_based(q, k, v, scale=d^-½, use_norm=True): 1 + s + s²/2, s = (q·scale)·k, eps 1e-6;
    and the Based TaylorExp map on q and k gives the same kernel."""
    q, k, v = _inputs(dk=16, N=40)
    scale = 16 ** -0.5
    s = (q * scale) @ k.transpose(-1, -2)
    attn = (1 + s + 0.5 * s ** 2).tril()
    fla = (attn @ v) / (attn.sum(-1)[..., None] + 1e-6)
    got = torch.ops.tk.linear_attention(q, k, v, "based", None, None, scale, True, 1e-6)
    torch.testing.assert_close(got, fla)

    def taylor(x):
        d = x.shape[-1]
        x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2)
        return torch.cat([torch.ones_like(x[..., :1]), x / d ** 0.25, x2 / math.sqrt(d)], -1)

    kern = (taylor(q) @ taylor(k).transpose(-1, -2)).tril()
    torch.testing.assert_close(got, (kern @ v) / (kern.sum(-1, keepdim=True) + 1e-6))


def test_identity_is_fla_chunk_linear_attn_with_normalize():
    """FLA chunk_linear_attn(normalize=True): o / ((q·scale)·cumsum(k) + 1e-10), o = Σ (q·scale)·k v."""
    q, k, v = _inputs()
    q, k = F.elu(q) + 1, F.elu(k) + 1  # FLA applies the map in the layer
    scale = q.shape[-1] ** -0.5
    kv = torch.einsum("bhnd,bhne->bhnde", k, v).cumsum(2)
    o = torch.einsum("bhnd,bhnde->bhne", q * scale, kv)
    o = o / ((q * scale * k.cumsum(2)).sum(-1, keepdim=True) + 1e-10)
    got = torch.ops.tk.linear_attention(q, k, v, "identity", None, None, scale, True, 1e-10)
    torch.testing.assert_close(got, o)


def test_output_dtype_layout_and_low_precision():
    q, k, v = (t.to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(dtype=torch.float32))
    o = torch.ops.tk.linear_attention(q, k, v, "elu1", None, None, 1.0, True, 1e-6)
    assert o.dtype == torch.bfloat16 and o.is_contiguous() and o.shape == v.shape
    want = _naive(*(t.double() for t in (q, k, v)), "elu1", None, None, 1.0, True, 1e-6)
    torch.testing.assert_close(o.double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("feature_map", la.FEATURE_MAPS)
def test_opcheck(feature_map):
    q, k, v = (t.float() for t in _inputs(N=9))
    qw, kw = (None if w is None else w.float().requires_grad_() for w in _weights(feature_map))
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.tk.linear_attention.default, (q, k, v, feature_map, qw, kw, 0.5, True, 1e-3))
    torch.library.opcheck(torch.ops.tk.linear_attention.default, (q, k, v, feature_map, qw, kw, 0.5, False, 0.0))


@pytest.mark.parametrize("feature_map", ["hedgehog", "based", "elu1"])
def test_gradcheck(feature_map):
    q, k, v = (t.requires_grad_() for t in _inputs(N=11, H=2, dk=3, dv=2))
    qw, kw = _weights(feature_map, H=2, dk=3, f=2)
    ws = [w.requires_grad_() for w in (qw, kw) if w is not None]

    def f(q, k, v, *ws):
        w = list(ws) + [None, None]
        return torch.ops.tk.linear_attention(q, k, v, feature_map, w[0], w[1], 0.7, True, 1e-3)

    assert torch.autograd.gradcheck(f, (q, k, v, *ws))


@pytest.mark.parametrize("bad, error", [
    (dict(q=torch.randn(2, 3, 4)), ValueError),
    (dict(k=torch.randn(2, 3, 8, 6)), ValueError),
    (dict(v=torch.randn(2, 3, 7, 4)), ValueError),
    (dict(v=torch.randn(2, 3, 8, 4, dtype=torch.float64)), TypeError),
    (dict(q=torch.randint(0, 3, (2, 3, 8, 5))), TypeError),
    (dict(feature_map="relu"), ValueError),
    (dict(feature_map="hedgehog"), TypeError),
    (dict(q_weight=torch.randn(5, 5)), ValueError),
    (dict(feature_map="hedgehog", q_weight=torch.randn(4, 5, 6), k_weight=torch.randn(5, 6)), ValueError),
    (dict(eps=-1.0), ValueError),
    (dict(scale=float("nan")), ValueError),
])
def test_bad_inputs_raise_clear_errors(bad, error):
    args = dict(q=torch.randn(2, 3, 8, 5), k=torch.randn(2, 3, 8, 5), v=torch.randn(2, 3, 8, 4), feature_map="elu1",
                q_weight=None, k_weight=None, scale=1.0, normalize=True, eps=1e-6)
    args.update(bad)
    with pytest.raises(error, match="tk::linear_attention"):
        torch.ops.tk.linear_attention(*args.values())


# ---------------------------------------------------------------------------- the rewrite

def _rewritten_ops(module, *inputs, options=None, outputs=None):
    """Compile with a backend that runs the rewrite, records the tk ops it inserted and runs the
    rewritten graph eagerly (autograd through the ops' registered backward)."""
    cfg = config.current({**OPTIONS, **(options or {})})
    seen = []

    def backend(gm, example_inputs):
        report, _ = rewrite.run(gm, cfg)
        seen.append(report)
        for n in gm.graph.nodes:
            if n.target is torch.ops.tk.linear_attention.default:
                seen.append(n.args[3:])
        return gm

    torch._dynamo.reset()
    out = torch.compile(module, backend=backend)(*inputs)
    if outputs is not None:
        outputs.append(out)
    return seen


SPELLINGS = [  # (form, feature map module, op feature map it must become)
    ("quadratic", "elu1", "elu1"), ("quadratic", "based", "based"), ("quadratic", "hedgehog", "hedgehog"),
    ("quadratic", "hedgehog_shared", "hedgehog"), ("quadratic", "identity", "identity"),
    ("masked_fill", "based", "based"), ("masked_fill", "elu1", "elu1"), ("mask_mul", "hedgehog", "hedgehog"),
    ("arange", "elu1", "elu1"), ("based", "based", "based"), ("based", "based_ones_like", "based"),
    ("based", "hedgehog", "hedgehog"), ("cumsum", "elu1", "elu1"), ("cumsum", "based", "based"),
    ("cumsum", "hedgehog", "hedgehog"), ("cumsum_bcast", "elu1", "elu1"), ("cumsum_bcast", "based", "based"),
    ("taylor_scores", "identity", "based"),
    ("quadratic", "hedgehog_lolcats", "hedgehog"), ("cumsum", "hedgehog_lolcats", "hedgehog"),
    # a bias that varies over the features, or a clamp that bites: already-mapped features
    ("quadratic", "hedgehog_feature_bias", "identity"), ("quadratic", "hedgehog_large_clamp", "identity"),
    # FLA's HedgehogFeatureMap is not the op's hedgehog: passed through as already-mapped features
    ("quadratic", "fla_hedgehog", "identity"), ("cumsum", "fla_hedgehog", "identity"),
    ("quadratic", "fla_taylor", "identity"),
]


@pytest.mark.parametrize("form, fmap, op_map", SPELLINGS)
@pytest.mark.parametrize("normalize", [True, False])
def test_spelling_is_replaced_and_equal(form, fmap, op_map, normalize):
    torch.manual_seed(0)
    scale = 0.7 if form in ("quadratic", "cumsum", "taylor_scores") and not fmap.startswith("based") else 1.0
    m = LinearAttention(feature_map=fmap, form=form, normalize=normalize, scale=scale)
    x = torch.randn(2, 11, 32, requires_grad=True)
    outputs = []
    seen = _rewritten_ops(m, x, outputs=outputs)
    assert seen[0].replaced.get("linear_attention") == 1, seen[0].kept
    feature_map, q_weight, k_weight, op_scale, op_normalize, eps = seen[1]
    assert feature_map == op_map and op_normalize == normalize
    if op_map == "based" and form != "taylor_scores":
        assert op_scale == pytest.approx(8 ** -0.5)  # the Taylor map's 1/√d folded into the scale
    elif op_map != "based":
        assert op_scale == pytest.approx(scale)
    assert eps == (pytest.approx(1e-6) if normalize else 0.0)

    out = outputs[0]
    want = m(x)
    # raw (sign-indefinite) features make the normaliser's denominator cross zero: ill-conditioned
    tol = dict(rtol=1e-3, atol=1e-3) if normalize and fmap == "identity" else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, want, **tol)
    # gradients through the op's autograd (the reference backward op)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *m.parameters()], grad, allow_unused=True)
    ref = torch.autograd.grad(want, [x, *m.parameters()], grad, allow_unused=True)
    for g, r in zip(got, ref):
        if r is None:
            assert g is None or not g.any()
            continue
        if g is None:  # a parameter the op does not read: a bias no softmax sees has a zero gradient in eager too
            assert r.abs().max() < 1e-5
            continue
        torch.testing.assert_close(g, r, **tol)


class TokensFirst(torch.nn.Module):
    """Linear attention on (B, N, H, d) tensors, as FLA and many research repos hold them (elu + 1 features)."""

    def __init__(self, form, scale=0.5, eps=1e-6):
        super().__init__()
        self.form, self.scale, self.eps = form, scale, eps

    def forward(self, q, k, v):
        fq, fk, s, eps = F.elu(q) + 1, F.elu(k) + 1, self.scale, self.eps
        if self.form == "einsum":  # scores (B, H, N, M), the row sum transposed back to the tokens-first output
            a = torch.einsum("bqhd,bkhd->bhqk", fq * s, fk).tril()
            return torch.einsum("bhqk,bkhd->bqhd", a, v) / (a.sum(-1).transpose(1, 2)[..., None] + eps)
        if self.form == "einsum_raw":
            a = (torch.einsum("bqhd,bkhd->bhqk", fq, fk) * s).tril()
            return torch.einsum("bhqk,bkhd->bqhd", a, v)
        if self.form == "cumsum":  # FLA's naive normaliser: q·cumsum(k) over the tokens, keepdim
            kv = torch.einsum("bthk,bthv->bthkv", fk, v).cumsum(1)
            o = torch.einsum("bthk,bthkv->bthv", fq * s, kv)
            return o / ((fq * s * fk.cumsum(1)).sum(-1, keepdim=True) + eps)
        if self.form == "wrong_den":  # the row sum left heads-first: with H == N it broadcasts, transposed
            a = torch.einsum("bqhd,bkhd->bhqk", fq, fk).tril()
            return torch.einsum("bhqk,bkhd->bqhd", a, v) / (a.sum(-1)[..., None] + eps)
        raise ValueError(self.form)


@pytest.mark.parametrize("form, normalize, scale", [("einsum", True, 0.5), ("einsum_raw", False, 0.5),
                                                    ("cumsum", True, 0.5), ("wrong_den", False, 1.0)])
def test_tokens_first_spellings_are_replaced_and_equal(form, normalize, scale):
    """(B, N, H, d) inputs go to the op as transposed views and its output comes back transposed; a denominator
    whose head and token axes are swapped (equal sizes, so it broadcasts) is not taken for the op's normaliser."""
    torch.manual_seed(0)
    m = TokensFirst(form, scale)
    H = 7 if form == "wrong_den" else 3
    q, k, v = (torch.randn(2, 7, H, d, requires_grad=True) for d in (8, 8, 5))
    outputs = []
    seen = _rewritten_ops(m, q, k, v, outputs=outputs)
    assert seen[0].replaced.get("linear_attention") == 1, seen[0].kept
    feature_map, _, _, op_scale, op_normalize, eps = seen[1]
    assert feature_map == "elu1" and op_normalize == normalize and op_scale == pytest.approx(scale)
    out, want = outputs[0], m(q, k, v)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v], grad)
    ref = torch.autograd.grad(want, [q, k, v], grad)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_scaled_taylor_features_fall_back_to_identity():
    """0.7·(φq·φk) with Based's map is not a Taylor kernel of any scale: the mapped features go in as is."""
    torch.manual_seed(0)
    m = LinearAttention(feature_map="based", form="quadratic", scale=0.7)
    seen = _rewritten_ops(m, torch.randn(2, 11, 32))
    assert seen[0].replaced.get("linear_attention") == 1
    assert seen[1][0] == "identity" and seen[1][3] == pytest.approx(0.7)


@pytest.mark.parametrize("form", ["noncausal", "window", "upper", "input_mask"])
def test_not_provably_causal_is_not_replaced(form):
    torch.manual_seed(0)
    m = LinearAttention(feature_map="elu1", form=form)
    x = torch.randn(2, 9, 32)
    mask = torch.ones(9, 9).tril()  # causal values, but an input: nothing proves it
    seen = _rewritten_ops(m, x, mask)
    assert "linear_attention" not in seen[0].replaced
    assert len(seen) == 1
    if form != "noncausal":
        assert any(f == "linear_attention" and "not provably causal" in r for f, r in seen[0].kept)


@pytest.mark.parametrize("validated", [False, True])
def test_training_follows_the_backward_kernel(validated, monkeypatch):
    """Until the Based backward kernel is validated, a graph that needs gradients keeps the subgraph (outside
    reference mode); after, only the device rule keeps it here (kernels are CUDA-only)."""
    monkeypatch.setattr(la, "BACKWARD_KERNEL_VALIDATED", validated)
    m = LinearAttention(feature_map="based", form="quadratic")
    seen = _rewritten_ops(m, torch.randn(2, 9, 32), options={"reference": False})
    assert "linear_attention" not in seen[0].replaced
    reasons = [r for f, r in seen[0].kept if f == "linear_attention"]
    assert reasons and all(r.startswith("device cpu") if validated else
                           r == "training, and the op has no backward kernel yet" for r in reasons)


def test_inference_without_reference_on_cpu_is_kept_for_the_device():
    m = LinearAttention(feature_map="elu1", form="cumsum")
    with torch.no_grad():
        seen = _rewritten_ops(m, torch.randn(2, 9, 32), options={"reference": False})
    assert "linear_attention" not in seen[0].replaced
    assert any(f == "linear_attention" and r.startswith("device cpu") for f, r in seen[0].kept)


@pytest.mark.parametrize("mixer", [dict(feature_map="based", form="based", feature_dim=16, head_dim=16),
                                   dict(feature_map="hedgehog", form="quadratic"),
                                   dict(feature_map="elu1", form="cumsum")])
def test_tiny_model_reference_mode_equals_eager(mixer):
    torch.manual_seed(0)
    model = TinyLM(layers=2, **mixer)
    ids = torch.randint(0, 64, (2, 21))
    torch._dynamo.reset()
    tk_inductor.reset()
    out = torch.compile(model, backend="thunderkittens", options=OPTIONS)(ids)
    assert tk_inductor.report().replaced.get("linear_attention") == 2
    want = model(ids)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    out.square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want.square().mean().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mixer", [dict(feature_map="based", form="based", feature_dim=16, head_dim=16),
                                   dict(feature_map="hedgehog", form="quadratic"),
                                   dict(feature_map="hedgehog_lolcats", form="cumsum"),
                                   dict(feature_map="elu1", form="cumsum")],
                         ids=["based", "hedgehog", "hedgehog-lolcats", "elu1"])
def test_tiny_model_under_autocast_equals_eager(mixer, dtype):
    """fp32 parameters under CPU autocast: every layer replaced as in one precision, and the loss and gradients
    within 1e-2 of eager autocast's (LoLCATs' fp32 bias promotes the features, and so the result, to fp32: the op's
    output is cast up as eager's is)."""
    torch.manual_seed(0)
    model = TinyLM(layers=2, **mixer)
    ids = torch.randint(0, 64, (2, 21))
    torch._dynamo.reset()
    tk_inductor.reset()
    compiled = torch.compile(model, backend="thunderkittens", options=OPTIONS)
    results = []
    for run in (compiled, model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            out = run(ids)
        out.float().square().mean().backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert tk_inductor.report().replaced.get("linear_attention") == 2, tk_inductor.report()
    (out, grads), (want, want_grads) = results
    assert out.dtype == want.dtype
    assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    # over all gradients, as tests/backend/test_autocast.py measures them; LoLCATs' per-head bias, which no softmax
    # sees, has none here and a zero one (up to rounding) in eager
    total = sum(g.float().pow(2).sum() for g in want_grads.values()).sqrt()
    diff = sum((grads[n].float() - g.float()).pow(2).sum() if n in grads else g.float().pow(2).sum()
               for n, g in want_grads.items()).sqrt()
    assert (diff / total).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("feature_map", la.FEATURE_MAPS)
def test_cuda_op_matches_reference(feature_map):
    """Whichever path runs on CUDA (kernel when built, else reference) against the fp64 reference."""
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _inputs(B=2, H=4, N=257, dk=16, dv=64, dtype=torch.float32))
    qw, kw = (None if w is None else w.cuda().float() for w in _weights(feature_map, H=4, dk=16, f=16, dtype=torch.float32))
    with torch.no_grad():
        o = torch.ops.tk.linear_attention(q, k, v, feature_map, qw, kw, 0.25, True, 1e-6)
    want = la.linear_attention_reference(*(t.double() for t in (q, k, v)), feature_map,
                                         *(None if w is None else w.double() for w in (qw, kw)), 0.25, True, 1e-6)
    assert not o.isnan().any()
    torch.testing.assert_close(o.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", ["quadratic", "masked_fill", "cumsum", "taylor_scores"])
def test_dynamic_sequence_length(form):
    """New lengths recompile with a symbolic N (automatic dynamic): still matched, masks proven by structure."""
    torch.manual_seed(0)
    m = LinearAttention(feature_map="based", form=form)
    torch._dynamo.reset()
    tk_inductor.reset()
    compiled = torch.compile(m, backend="thunderkittens", options=OPTIONS)
    for n in (9, 13, 17):
        x = torch.randn(2, n, 32)
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
    assert tk_inductor.report().replaced.get("linear_attention") == 2  # the static graph and the dynamic one


def test_kernel_supports_names_what_the_kernels_do_not_compute():
    assert "feature dim 16 (the 'identity' kernel takes 64 or 128)" in la.kernel_supports("identity", torch.bfloat16, 16, 64)
    assert "feature map 'hedgehog'" in la.kernel_supports("hedgehog", torch.bfloat16, 64, 64)  # no weights
    assert "feature map 'based'" in la.kernel_supports("based", torch.bfloat16, 16, 64, projections=16)
    assert la.kernel_supports("hedgehog", torch.bfloat16, 64, 64, projections=64) is None
    assert la.kernel_supports("hedgehog", torch.bfloat16, 128, 128, projections=32) is None
    assert "48 Hedgehog projections" in la.kernel_supports("hedgehog", torch.bfloat16, 64, 64, projections=48)
    assert "feature dim 96" in la.kernel_supports("hedgehog", torch.bfloat16, 96, 64, projections=64)
    assert la.kernel_supports("elu1", torch.bfloat16, 128, 64) is None
    assert la.kernel_supports("identity", torch.bfloat16, 64, 128) is None
    assert "dtype torch.float16" in la.kernel_supports("elu1", torch.float16, 64, 64)
    assert "dtype torch.float16" in la.kernel_supports("based", torch.float16, 16, 64)
    assert "feature dim 32" in la.kernel_supports("based", torch.bfloat16, 32, 64)
    assert "value dim 96" in la.kernel_supports("based", torch.bfloat16, 16, 96)
    assert la.kernel_supports("based", torch.bfloat16, 16, 128) is None
