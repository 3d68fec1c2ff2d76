"""CPU tests of the layernorm family: the Philox reference, tk::layernorm(_backward), and the matcher.

Reference mode runs the op's PyTorch reference, so every replaced graph is compared with eager
(forward and gradients, fp32, tight tolerance)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor.ops import layernorm as ln_ops
from tk_inductor.ops import philox

OPTS = {"reference": True, "inner": "aot_eager"}


def compiled(m):
    return torch.compile(m, backend="thunderkittens", options=OPTS)


def grads(out, inputs, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out * g).sum(), inputs)


def assert_close_all(a, b, tol=1e-5):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------- philox

def _words(ctr, key):
    t = tuple(torch.tensor([c], dtype=torch.int64) for c in ctr)
    return [int(w) for w in philox.philox4x32(t, key)]


def test_philox_known_answers():
    # Random123's published Philox4x32-10 known-answer vectors.
    assert _words((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert _words((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert _words((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_philox_stream_layout():
    # element e uses word e % 4 of counter (e // 4, offset)
    seed, offset = 0x1234567890ABCDEF, 0xFEDCBA9876543210
    words = philox.random_words(12, seed, offset)
    g = 2
    ctr = (g, 0, offset & 0xFFFFFFFF, offset >> 32)
    assert [int(w) for w in words[8:12]] == _words(ctr, (seed & 0xFFFFFFFF, seed >> 32))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_philox_keep_rate_and_independence(p):
    n = 1 << 18
    keep = philox.keep_mask((n,), 7, 3, p).double()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean().item() - (1 - p)) < 4 * sigma
    # neighbours uncorrelated (words of one counter and across counters)
    k = keep - keep.mean()
    corr = (k[1:] * k[:-1]).mean() / k.var()
    assert abs(corr.item()) < 4 / math.sqrt(n)
    # another offset or seed gives another mask; the same gives the same
    assert torch.equal(philox.keep_mask((n,), 7, 3, p), philox.keep_mask((n,), 7, 3, p))
    assert not torch.equal(philox.keep_mask((n,), 7, 4, p), philox.keep_mask((n,), 7, 3, p))
    assert not torch.equal(philox.keep_mask((n,), 8, 3, p), philox.keep_mask((n,), 7, 3, p))


def test_philox_threshold_and_seed():
    assert philox.threshold(0.0) == 0
    assert philox.threshold(0.5) == 1 << 31
    assert philox.threshold(1 - 1e-12) <= 0xFFFFFFFF
    with pytest.raises(ValueError):
        philox.threshold(1.0)
    torch.manual_seed(3)
    a = philox.draw_seed()
    torch.manual_seed(3)
    assert torch.equal(a, philox.draw_seed())
    assert not torch.equal(philox.draw_seed(), philox.draw_seed())


# ---------------------------------------------------------------------------- the op

def _eager(x, residual, weight, bias, eps, rms):
    h = x if residual is None else residual + x
    if rms:
        y = F.rms_norm(h, (h.shape[-1],), weight, eps)
    else:
        y = F.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    return y, h


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_op_matches_eager(rms, with_residual, affine):
    torch.manual_seed(0)
    H = 48
    x = torch.randn(3, 7, H, requires_grad=True)
    r = torch.randn(3, 7, H, requires_grad=True) if with_residual else None
    w = torch.randn(H, requires_grad=True) if affine else None
    b = torch.randn(H, requires_grad=True) if affine and not rms else None
    y, h, mean, rstd, rng = torch.ops.tk.layernorm(x, r, w, b, None, 1e-5, 0.0, rms)
    ye, he = _eager(x, r, w, b, 1e-5, rms)
    torch.testing.assert_close(y, ye, atol=1e-5, rtol=1e-5)
    assert h.numel() == (x.numel() if with_residual else 0)
    assert mean.shape == ((0,) if rms else (21,)) and rstd.shape == (21,)
    assert torch.equal(rng, torch.zeros(2, dtype=torch.int64))
    inputs = [t for t in (x, r, w, b) if t is not None]
    gy = torch.randn_like(y)
    gh = torch.randn_like(ye)
    loss = (y * gy).sum() + ((h * gh).sum() if with_residual else 0)
    loss_e = (ye * gy).sum() + ((he * gh).sum() if with_residual else 0)
    assert_close_all(torch.autograd.grad(loss, inputs), torch.autograd.grad(loss_e, inputs), tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_op_low_precision(dtype):
    torch.manual_seed(0)
    x, r = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    w, b = torch.randn(64, dtype=dtype), torch.randn(64, dtype=dtype)
    y, h, *_ = torch.ops.tk.layernorm(x, r, w, b, None, 1e-5, 0.0, False)
    ye, he = _eager(x.float(), r.float(), w.float(), b.float(), 1e-5, False)
    assert y.dtype == dtype and h.dtype == dtype
    torch.testing.assert_close(h, (x + r))
    torch.testing.assert_close(y.float(), ye, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("with_residual", [False, True])
def test_op_dropout(with_residual):
    torch.manual_seed(0)
    p, H = 0.3, 256
    x = torch.randn(64, H, requires_grad=True)
    r = torch.randn(64, H, requires_grad=True) if with_residual else None
    w = torch.randn(H, requires_grad=True)
    rng = torch.tensor([123456789, 42])
    y, h, mean, rstd, rng_out = torch.ops.tk.layernorm(x, r, w, None, rng, 1e-5, p, False)
    assert torch.equal(rng_out, rng)
    keep = philox.keep_mask(x.shape, 123456789, 42, p)
    scale = philox.dropout_scale(p)
    expect_h = torch.where(keep, x * scale, torch.zeros(())) + (r if with_residual else 0)
    torch.testing.assert_close(h, expect_h, atol=0, rtol=0)
    # kept fraction within 4 sigma
    n = keep.numel()
    assert abs(keep.double().mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)
    # gradients consistent with the regenerated mask
    ye = F.layer_norm(expect_h, (H,), w, None, 1e-5)
    inputs = [t for t in (x, r, w) if t is not None]
    g, ge = grads(y, inputs), grads(ye, inputs)
    assert_close_all(g, ge, tol=1e-4)
    assert (g[0][~keep] == 0).all()


def test_op_dropout_draws_from_the_default_generator():
    x = torch.randn(8, 64)
    torch.manual_seed(5)
    a = torch.ops.tk.layernorm(x, None, None, None, None, 1e-5, 0.5, False)
    torch.manual_seed(5)
    b = torch.ops.tk.layernorm(x, None, None, None, None, 1e-5, 0.5, False)
    assert torch.equal(a[1], b[1]) and torch.equal(a[4], b[4])
    c = torch.ops.tk.layernorm(x, None, None, None, None, 1e-5, 0.5, False)
    assert not torch.equal(a[1], c[1])


def test_backward_op_direct():
    torch.manual_seed(0)
    H = 32
    h = torch.randn(10, H)
    dy, dh, w = torch.randn(10, H), torch.randn(10, H), torch.randn(H)
    y, _, mean, rstd, rng = torch.ops.tk.layernorm(h, None, w, None, None, 1e-5, 0.0, False)
    dres, dx, dw, db, _ = torch.ops.tk.layernorm_backward(dy, dh, h, w, mean, rstd, rng, 0.0, False, True)
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    bb = torch.zeros(H, requires_grad=True)
    ye = F.layer_norm(hh, (H,), ww, bb, 1e-5)
    g = torch.autograd.grad((ye * dy).sum(), (hh, ww, bb))
    torch.testing.assert_close(dres, g[0] + dh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, g[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(db, g[2], atol=1e-5, rtol=1e-5)
    assert dx.numel() == 0


@pytest.mark.parametrize(
    "args",
    [
        lambda: (torch.randn(3, 64), torch.randn(3, 64), torch.randn(64), torch.randn(64), None, 1e-5, 0.0, False),
        lambda: (torch.randn(3, 64), None, torch.randn(64), None, torch.tensor([1, 2]), 1e-6, 0.25, True),
        lambda: (torch.randn(2, 3, 16, dtype=torch.bfloat16), None, None, None, None, 1e-5, 0.0, False),
    ],
)
def test_opcheck(args):
    a = list(args())
    for i in (0, 1, 2, 3):
        if a[i] is not None and a[i].is_floating_point():
            a[i].requires_grad_()
    torch.library.opcheck(torch.ops.tk.layernorm.default, tuple(a))


def test_opcheck_backward():
    h = torch.randn(4, 16)
    y, _, mean, rstd, rng = torch.ops.tk.layernorm(h, None, torch.randn(16), None, None, 1e-5, 0.0, False)
    torch.library.opcheck(torch.ops.tk.layernorm_backward.default,
                          (torch.randn(4, 16), torch.randn(4, 16), h, torch.randn(16), mean, rstd, rng, 0.0, False, True))


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: torch.ops.tk.layernorm(torch.randn(2, 12), None, None, None, None, 1e-5, 0.0, False), ValueError),
        (lambda: torch.ops.tk.layernorm(torch.randn(2, 16 * 1025 + 8), None, None, None, None, 1e-5, 0.0, False), ValueError),
        (lambda: torch.ops.tk.layernorm(torch.ones(2, 16, dtype=torch.int32), None, None, None, None, 1e-5, 0.0, False), TypeError),
        (lambda: torch.ops.tk.layernorm(torch.randn(2, 16), torch.randn(2, 8), None, None, None, 1e-5, 0.0, False), ValueError),
        (lambda: torch.ops.tk.layernorm(torch.randn(2, 16), None, torch.randn(8), None, None, 1e-5, 0.0, False), ValueError),
        (lambda: torch.ops.tk.layernorm(torch.randn(2, 16), None, torch.randn(16).double(), None, None, 1e-5, 0.0, False), TypeError),
        (lambda: torch.ops.tk.layernorm(torch.randn(2, 16), None, None, torch.randn(16), None, 1e-5, 0.0, True), ValueError),
        (lambda: torch.ops.tk.layernorm(torch.randn(2, 16), None, None, None, None, 1e-5, 1.0, False), ValueError),
        (lambda: torch.ops.tk.layernorm(torch.randn(2, 16), None, None, None, torch.tensor([1.0, 2.0]), 1e-5, 0.1, False), ValueError),
    ],
)
def test_bad_inputs(call, error):
    with pytest.raises(error):
        call()


# ---------------------------------------------------------------------------- the matcher

class ResidualLN(nn.Module):
    """GPT-2 / BERT style: LayerNorm(dropout(dense(x)) + residual); the sum is reused."""

    def __init__(self, H=64, p=0.0, affine=True, swap=False):
        super().__init__()
        self.dense = nn.Linear(H, H)
        self.drop = nn.Dropout(p)
        self.ln = nn.LayerNorm(H, elementwise_affine=affine)
        self.swap = swap

    def forward(self, x, r):
        d = self.drop(self.dense(x))
        h = r + d if self.swap else d + r
        return self.ln(h) * 2 + h


class LlamaStyleRMS(nn.Module):
    def __init__(self, H=64, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))
        self.eps = eps

    def forward(self, x, r):
        h = r + x
        dtype = h.dtype
        v = h.to(torch.float32)
        var = v.pow(2).mean(-1, keepdim=True)
        v = v * torch.rsqrt(var + self.eps)
        return self.weight * v.to(dtype), h


class T5StyleRMS(nn.Module):
    def __init__(self, H=64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))

    def forward(self, x):
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + 1e-6)
        return self.weight * x


class FunctionalRMS(nn.Module):
    def __init__(self, H=64, weight=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H)) if weight else None

    def forward(self, x, r):
        h = x + r
        return F.rms_norm(h, (h.shape[-1],), self.weight, 1e-5), h


def _check_model(m, inputs, family_count, tol=1e-5):
    tk_inductor.reset()
    c = compiled(m)
    out, ref = c(*inputs), m(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    assert_close_all(out, ref, tol)
    params = [p for p in m.parameters()] + [t for t in inputs if t.requires_grad]
    loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in out)
    loss_ref = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in ref)
    assert_close_all(torch.autograd.grad(loss, params), torch.autograd.grad(loss_ref, params), tol=1e-4)
    assert tk_inductor.report().replaced.get("layernorm", 0) == family_count, str(tk_inductor.report())


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("swap", [True, False])
def test_matches_residual_layernorm(affine, swap):
    torch.manual_seed(0)
    m = ResidualLN(affine=affine, swap=swap)
    x, r = torch.randn(2, 5, 64, requires_grad=True), torch.randn(2, 5, 64, requires_grad=True)
    _check_model(m, (x, r), 1)


def test_matches_eval_dropout():
    torch.manual_seed(0)
    m = ResidualLN(p=0.5).eval()
    _check_model(m, (torch.randn(2, 5, 64), torch.randn(2, 5, 64)), 1)


@pytest.mark.parametrize("module", [LlamaStyleRMS, FunctionalRMS])
def test_matches_residual_rmsnorm(module):
    torch.manual_seed(0)
    m = module()
    _check_model(m, (torch.randn(3, 64, requires_grad=True), torch.randn(3, 64, requires_grad=True)), 1)


def test_matches_t5_rmsnorm_and_functional_without_weight():
    torch.manual_seed(0)
    _check_model(T5StyleRMS(), (torch.randn(4, 64, requires_grad=True),), 1)
    _check_model(FunctionalRMS(weight=False), (torch.randn(4, 64, requires_grad=True), torch.randn(4, 64)), 1)


class WrittenLN(nn.Module):
    """LayerNorm written out: Cohere's CohereLayerNorm (mean, the biased variance of the centred rows, rsqrt, an fp32
    weight), `var(unbiased=False)` with a bias, and `(x - mean) / sqrt(var + eps)`."""

    def __init__(self, form, H=64):
        super().__init__()
        self.form, self.weight = form, nn.Parameter(torch.randn(H))
        self.bias = nn.Parameter(torch.randn(H)) if form != "cohere" else None

    def forward(self, x, r):
        h = x + r
        a = h.to(torch.float32)
        mean = a.mean(-1, keepdim=True)
        if self.form == "cohere":
            var = (a - mean).pow(2).mean(-1, keepdim=True)
            return (self.weight.to(torch.float32) * ((a - mean) * torch.rsqrt(var + 1e-5))).to(h.dtype), h
        if self.form == "var":
            var = a.var(-1, keepdim=True, unbiased=False)
            return (a - mean) * torch.rsqrt(var + 1e-5) * self.weight + self.bias, h
        var = torch.square(a - mean).mean(dim=-1, keepdim=True)
        return self.weight * ((a - mean) / torch.sqrt(var + 1e-6)) + self.bias, h


@pytest.mark.parametrize("form", ["cohere", "var", "sqrt"])
def test_matches_written_layernorm(form):
    torch.manual_seed(0)
    x, r = torch.randn(3, 64, requires_grad=True), torch.randn(3, 64, requires_grad=True)
    _check_model(WrittenLN(form), (x, r), 1)


class UnbiasedLN(nn.Module):
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5)  # the unbiased variance: not LayerNorm


def test_training_dropout_uses_the_philox_stream():
    torch.manual_seed(0)
    m = ResidualLN(p=0.25)
    x, r = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64)
    tk_inductor.reset()
    c = compiled(m)
    torch.manual_seed(11)
    out = c(x, r)
    assert tk_inductor.report().replaced.get("layernorm") == 1
    torch.manual_seed(11)
    rng = philox.draw_seed()
    d = m.dense(x)
    y, h, *_ = ln_ops.reference_forward(d, r, m.ln.weight, m.ln.bias, rng, 1e-5, 0.25, False)
    expect = y * 2 + h
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    # the backward regenerates the same mask: dropped inputs get no gradient
    keep = philox.keep_mask(d.shape, *philox.unpack(rng), 0.25)
    gd = torch.autograd.grad(out.sum(), x)[0]
    torch.manual_seed(11)
    d2 = m.dense(x)
    y2, h2, *_ = torch.ops.tk.layernorm(d2, r, m.ln.weight, m.ln.bias, rng, 1e-5, 0.25, False)
    torch.testing.assert_close(gd, torch.autograd.grad((y2 * 2 + h2).sum(), x)[0], atol=1e-5, rtol=1e-5)
    assert keep.float().mean() < 1


def _hf_tiny(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32)
        return transformers.GPT2Model(cfg).eval(), 5  # ln_1, ln_2 per layer + ln_f
    if name == "bert":
        cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                      vocab_size=100, max_position_embeddings=32)
        return transformers.BertModel(cfg, add_pooling_layer=False).eval(), 5  # embeddings + 2 per layer
    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=128, vocab_size=100, max_position_embeddings=32)
        return transformers.LlamaModel(cfg).eval(), 5  # 2 per layer + final norm


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_hf_models(name):
    model, count = _hf_tiny(name)
    ids = torch.randint(0, 100, (2, 12))
    tk_inductor.reset()
    c = compiled(model)
    out = c(input_ids=ids).last_hidden_state
    ref = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert tk_inductor.report().replaced.get("layernorm", 0) == count, str(tk_inductor.report())
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    ga = torch.autograd.grad((out * g).sum(), params, allow_unused=True)
    gb = torch.autograd.grad((ref * g).sum(), params, allow_unused=True)
    for a, b in zip(ga, gb):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------- must not replace

class TwoDimLN(nn.Module):
    def forward(self, x):
        return F.layer_norm(x, x.shape[-2:])


class OddHidden(nn.Module):
    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],))


class MeanOverRows(nn.Module):
    def __init__(self, H=64):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))

    def forward(self, x):
        var = x.pow(2).mean(-2, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + 1e-6))


class MixedDtypeRMS(nn.Module):
    """HF LlamaRMSNorm with an fp32 weight on bf16 activations: the output is promoted to fp32 (tested in
    test_mixed_dtypes_replaced)."""

    def __init__(self, H=64):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))

    def forward(self, x):
        v = x.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * v.to(x.dtype)


@pytest.mark.parametrize(
    "module, x, reason",
    [
        (TwoDimLN(), torch.randn(2, 4, 16), "trailing dims"),
        (OddHidden(), torch.randn(2, 36), "hidden size 36"),
        (OddHidden(), torch.randn(2, 64, dtype=torch.float64), "dtype torch.float64"),
    ],
)
def test_kept_with_reason(module, x, reason):
    tk_inductor.reset()
    out = compiled(module)(x)
    torch.testing.assert_close(out, module(x))
    rep = tk_inductor.report()
    assert not rep.replaced.get("layernorm"), str(rep)
    assert any(f == "layernorm" and reason in r for f, r in rep.kept), str(rep)


@pytest.mark.parametrize("module", [MeanOverRows, UnbiasedLN])
def test_not_matched_other_statistics(module):
    tk_inductor.reset()
    m = module()
    x = torch.randn(4, 64)
    torch.testing.assert_close(compiled(m)(x), m(x))
    rep = tk_inductor.report()
    assert not rep.replaced.get("layernorm") and not any(f == "layernorm" for f, _ in rep.kept), str(rep)


def test_runtime_eps_under_dynamic_true_is_replaced():
    """dynamic=True passes float attributes as tensors (`eps.item()`, a symbolic float) and makes the hidden size
    symbolic: the norm is still replaced, with eps guarded as a constant (Dynamo restarts its analysis once to
    specialise it; the discarded first attempt leaves no report), and new sizes need no recompile."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = LlamaRMSNorm(64)

        def forward(self, x, r):
            return self.norm(x + r)

    tk_inductor.reset()
    torch._dynamo.utils.counters.clear()
    m = Block()
    c = torch.compile(m, backend="thunderkittens", options={"reference": True, "inner": "aot_eager"}, dynamic=True)
    x, r = torch.randn(2, 7, 64, requires_grad=True), torch.randn(2, 7, 64)
    out = c(x, r)
    torch.testing.assert_close(out, m(x, r))
    (ga,), (gb,) = torch.autograd.grad(out.sum(), x), torch.autograd.grad(m(x, r).sum(), x)
    torch.testing.assert_close(ga, gb)
    assert tk_inductor.report().replaced.get("layernorm") == 1, str(tk_inductor.report())
    x2, r2 = torch.randn(3, 11, 64, requires_grad=True), torch.randn(3, 11, 64)
    torch.testing.assert_close(c(x2, r2), m(x2, r2))
    assert len(tk_inductor.report().graphs) == 1  # no recompile for new sizes
    m.norm.variance_epsilon = 1e-2  # a guarded constant: recompiles, never a stale value
    torch.testing.assert_close(c(x2, r2), m(x2, r2))


@pytest.mark.parametrize("mode", ["train", "no_grad", "frozen"])
def test_stats_only_where_a_backward_can_run(mode):
    """The matcher asks for mean/rstd (stats=True) only when grad mode is on and an input needs grad: an
    inference graph's op writes no statistics (~1% of the forward at hidden 1024)."""
    import contextlib

    from tk_inductor.patterns import layernorm as P

    seen = []

    def backend(gm, example_inputs):
        seen.extend(P.find(gm.graph))
        return gm

    torch._dynamo.reset()
    m = ResidualLN()
    if mode == "frozen":
        m.requires_grad_(False)
    x, r = torch.randn(2, 5, 64, requires_grad=mode == "train"), torch.randn(2, 5, 64)
    with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
        torch.compile(m, backend=backend)(x, r)
    (match,) = seen
    assert match.args[8] is (mode == "train")


def test_stats_false_outputs_and_no_backward():
    torch.manual_seed(0)
    x, r, w, b = torch.randn(6, 64), torch.randn(6, 64), torch.randn(64), torch.randn(64)
    full = torch.ops.tk.layernorm(x, r, w, b, None, 1e-5, 0.0, False)
    lean = torch.ops.tk.layernorm(x, r, w, b, None, 1e-5, 0.0, False, stats=False)
    torch.testing.assert_close(lean[0], full[0], rtol=0, atol=0)
    torch.testing.assert_close(lean[1], full[1], rtol=0, atol=0)
    assert lean[2].numel() == 0 and lean[3].numel() == 0
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="stats=False"):
        torch.ops.tk.layernorm(xg, r, w, b, None, 1e-5, 0.0, False, stats=False)


class RmsTimesWeight(nn.Module):
    """`rms_norm(h) * w` with the weight applied outside the norm: the weight is the op's."""

    def __init__(self, H=64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))

    def forward(self, x, r):
        h = x + r
        return F.rms_norm(h, (h.shape[-1],), eps=1e-6) * self.weight, h


class LnAffineApart(nn.Module):
    def __init__(self, H=64):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(H)), nn.Parameter(torch.randn(H))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],)) * self.weight + self.bias


@pytest.mark.parametrize("module, n_in", [(RmsTimesWeight(), 2), (LnAffineApart(), 1)])
def test_weight_and_bias_written_after_the_norm_are_the_ops(module, n_in, replaced_matches):
    torch.manual_seed(0)
    xs = [torch.randn(4, 64, requires_grad=True) for _ in range(n_in)]
    tk_inductor.reset()
    out = compiled(module)(*xs)
    ref = module(*xs)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for a, b in zip(outs, refs):
        torch.testing.assert_close(a, b)
    (match,) = replaced_matches
    assert match.args[2] is not None  # the weight
    assert (match.args[3] is not None) == isinstance(module, LnAffineApart)
    params = list(module.parameters())
    ga = torch.autograd.grad(sum(o.sum() for o in outs), params + xs)
    gb = torch.autograd.grad(sum(o.sum() for o in refs), params + xs)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
