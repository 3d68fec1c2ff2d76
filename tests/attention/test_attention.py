"""Attention family: the tk::attention ops (reference, autograd, opcheck, input errors) and the matcher
(every SDPA/eager spelling replaced and equal to eager in reference mode, every unprovable case kept)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor import rewrite
from tk_inductor.config import Config
from tk_inductor.ops import attention as A
from tk_inductor.patterns import attention as P

OPTS = {"reference": True, "inner": "aot_eager"}


# ============================================================================ the ops

def _qkv(B, Hq, Hkv, N, M, D, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, M, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, M, D, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


SHAPES = [  # B, Hq, Hkv, N, M, D
    (2, 4, 4, 7, 7, 16),
    (1, 4, 2, 5, 9, 8),   # GQA, N < M
    (2, 6, 3, 9, 4, 8),   # GQA, N > M
    (1, 4, 1, 1, 6, 16),  # MQA, one query
    (3, 2, 2, 6, 1, 8),   # one key
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_sdpa(shape, causal):
    B, Hq, Hkv, N, M, D = shape
    q, k, v = _qkv(*shape)
    scale = 0.37
    o, lse = torch.ops.tk.attention(q, k, v, causal, scale)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    # o is a (B, Hq, N, D) view of a (B, N, Hq, D) contiguous buffer; lse is fp32 (B, Hq, N) contiguous
    assert o.shape == (B, Hq, N, D) and o.transpose(1, 2).is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, N) and lse.is_contiguous()
    s = (q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(N, M, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_autograd(shape, causal):
    q, k, v = _qkv(*shape, dtype=torch.float32, grad=True)
    o, _ = torch.ops.tk.attention(q, k, v, causal, 0.5)
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        assert a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_low_precision_reference_accumulates_in_fp32():
    q, k, v = _qkv(2, 4, 2, 33, 40, 64, dtype=torch.float32)
    o, lse = torch.ops.tk.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), True, 0.125)
    ref = F.scaled_dot_product_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(),
                                         is_causal=True, scale=0.125, enable_gqa=True)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), ref, rtol=1e-2, atol=1e-2)
    assert (o.float() - ref).abs().max() <= ref.abs().max() * 2 ** -7  # bf16 rounding of the output only


def test_any_strides():
    q, k, v = _qkv(2, 4, 2, 5, 6, 8)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) storage
    o, _ = torch.ops.tk.attention(qt, k, v, True, 0.3)
    torch.testing.assert_close(o, torch.ops.tk.attention(q, k, v, True, 0.3)[0])


def test_empty_query():
    q, k, v = _qkv(2, 4, 2, 0, 6, 8)
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.3)
    assert o.shape == (2, 4, 0, 8) and lse.shape == (2, 4, 0)


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck(causal):
    q, k, v = _qkv(2, 4, 2, 5, 7, 8, dtype=torch.float32, grad=True)
    torch.library.opcheck(torch.ops.tk.attention.default, (q, k, v, causal, 0.3))
    o, lse = torch.ops.tk.attention(q.detach(), k.detach(), v.detach(), causal, 0.3)
    torch.library.opcheck(torch.ops.tk.attention_backward.default,
                          (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse, causal, 0.3))


def test_fake_strides_match_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv(2, 4, 2, 5, 7, 8, dtype=torch.float32)
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.3)
    with FakeTensorMode() as mode:
        fo, flse = torch.ops.tk.attention(*(mode.from_tensor(t) for t in (q, k, v)), True, 0.3)
    assert fo.stride() == o.stride() and flse.stride() == lse.stride()
    assert fo.shape == o.shape and flse.dtype == lse.dtype


@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "one_head"])
def test_backward_gradients_take_the_inputs_layout(layout):
    """dq/dk/dv are (B, N, H, D)-major when the inputs are (HF's projections, read by their backward without a copy),
    contiguous otherwise; the fake gives the same strides as the reference (and the kernel: grad_like)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv(2, 1 if layout == "one_head" else 4, 1 if layout == "one_head" else 2, 5, 7, 8, dtype=torch.float32)
    if layout != "bhnd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.3)
    do = torch.randn_like(o)
    grads = torch.ops.tk.attention_backward(do, q, k, v, o, lse, True, 0.3)
    with FakeTensorMode() as mode:
        fakes = torch.ops.tk.attention_backward(*(mode.from_tensor(t) for t in (do, q, k, v, o, lse)), True, 0.3)
    for g, f, like in zip(grads, fakes, (q, k, v)):
        assert g.stride() == f.stride() and g.shape == like.shape
        if layout == "bnhd":
            assert g.transpose(1, 2).is_contiguous() and not g.is_contiguous()
        else:
            assert g.is_contiguous()
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, scale=0.3, enable_gqa=True)
    for g, w in zip(grads, torch.autograd.grad(out, ref, do)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad, error, message", [
    (lambda q, k, v: (q[0], k, v), ValueError, "4-D"),
    (lambda q, k, v: (q, k.double(), v), TypeError, "dtypes differ"),
    (lambda q, k, v: (q, k, v.to("meta")), ValueError, "devices differ"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "floating"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)), ValueError,
     "multiple of key/value heads"),
    (lambda q, k, v: (q, k[..., :4], v[..., :4]), ValueError, "head dim"),
    (lambda q, k, v: (q, k, v[:, :, :2]), ValueError, "same shape"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "empty"),
])
def test_bad_inputs(bad, error, message):
    q, k, v = _qkv(2, 4, 2, 5, 6, 8, dtype=torch.float32)
    with pytest.raises(error, match=message):
        torch.ops.tk.attention(*bad(q, k, v), False, 0.5)


def test_bad_scale_and_backward_inputs():
    q, k, v = _qkv(2, 4, 2, 5, 6, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="finite"):
        torch.ops.tk.attention(q, k, v, False, math.inf)
    o, lse = torch.ops.tk.attention(q, k, v, False, 0.5)
    with pytest.raises(ValueError, match="lse shape"):
        torch.ops.tk.attention_backward(o, q, k, v, o, lse[:, :2], False, 0.5)
    with pytest.raises(TypeError, match="lse must be float32"):
        torch.ops.tk.attention_backward(o, q, k, v, o, lse.double(), False, 0.5)
    with pytest.raises(ValueError, match="grad_o shape"):
        torch.ops.tk.attention_backward(o[:, :, :2], q, k, v, o, lse, False, 0.5)


def test_kernel_supports():
    assert A.kernel_supports(torch.bfloat16, 128) is None
    assert A.kernel_supports(torch.float16, 64) is None
    assert "dtype" in A.kernel_supports(torch.float32, 64)
    assert "head dim 96" in A.kernel_supports(torch.bfloat16, 96)


# ============================================================================ the matcher, end to end (CPU, reference)

def _compile(model, options=None):
    tk_inductor.reset()
    torch._dynamo.reset()
    return torch.compile(model, backend="thunderkittens", options=options or OPTS)


def _check(model, *inputs, replaced=1, grad=True, tol=1e-5, kept=0):
    """Compiled (reference mode) == eager, forward and gradients; the report says what was replaced."""
    inputs = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]
    ref_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = _compile(model)(*inputs)
    report = tk_inductor.report()
    ref = model(*ref_inputs)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert report.replaced.get("attention", 0) == replaced, str(report)
    assert len([r for f, r in report.kept if f == "attention"]) == kept, str(report)
    if grad:
        w = torch.randn_like(ref)
        params = [p for p in model.parameters() if p.requires_grad]
        got = torch.autograd.grad((out * w).sum(), [x for x in inputs if x.requires_grad] + params)
        model.zero_grad(set_to_none=True)
        want = torch.autograd.grad((ref * w).sum(), [x for x in ref_inputs if x.requires_grad] + params)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return report


def _kept(model, *inputs, options=None):
    """Compile and return the attention kept reasons (output still equals eager)."""
    out = _compile(model, options)(*inputs)
    report = tk_inductor.report()
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
    assert report.replaced.get("attention", 0) == 0, str(report)
    reasons = [r for f, r in report.kept if f == "attention"]
    assert reasons, str(report)
    return reasons


def _inputs(B=2, Hq=4, Hkv=4, N=8, M=8, D=16, seed=0):
    return _qkv(B, Hq, Hkv, N, M, D, dtype=torch.float32, seed=seed)


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def repeat_kv(x, n_rep):  # HF's spelling
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


# ---------------------------------------------------------------------------- SDPA spellings

@pytest.mark.parametrize("N, M", [(8, 8), (8, 5), (5, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(N, M, causal):
    _check(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), *_inputs(N=N, M=M))


def test_sdpa_scale_gqa_dropout0():
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True, scale=0.3,
                                                        enable_gqa=True)
    _check(Fn(fn), *_inputs(Hq=8, Hkv=2))


def test_sdpa_after_repeat_kv():
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)
    _check(Fn(fn), *_inputs(Hq=8, Hkv=2))


def test_sdpa_three_d():
    _check(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
           *(t[:, 0] for t in _inputs(N=6, M=9)))


def test_sdpa_with_in_graph_causal_masks():
    def bool_mask(q, k, v):
        N, M = q.shape[-2], k.shape[-2]
        mask = torch.ones(N, M, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def float_mask(q, k, v):
        N, M = q.shape[-2], k.shape[-2]
        mask = torch.full((N, M), float("-inf"), device=q.device).triu(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    _check(Fn(bool_mask), *_inputs(N=8, M=11))
    _check(Fn(float_mask), *_inputs(N=11, M=8))


# ---------------------------------------------------------------------------- eager spellings

def _eager(product="matmul", scale="mul_scores", mask="masked_fill_tril", softmax="f", gqa=1, dropout=None):
    """Build an eager attention function from interchangeable spellings."""

    def fn(q, k, v):
        B, H, N, D = q.shape
        M = k.shape[-2]
        k, v = repeat_kv(k, gqa), repeat_kv(v, gqa)
        if scale == "q_mul":
            q = q * D ** -0.5
        if product == "matmul":
            s = torch.matmul(q, k.transpose(2, 3))
        elif product == "at":
            s = q @ k.transpose(-2, -1)
        elif product == "mT":
            s = q @ k.mT
        elif product == "permute":
            s = q.matmul(k.permute(0, 1, 3, 2))
        elif product == "bmm":
            s = torch.bmm(q.reshape(B * H, N, D), k.reshape(B * H, M, D).transpose(1, 2)).view(B, H, N, M)
        elif product == "einsum":
            s = torch.einsum("bhnd,bhmd->bhnm", q, k)
        if scale == "mul_scores":
            s = s * D ** -0.5
        elif scale == "div_scores":
            s = s / math.sqrt(D)
        allowed = torch.ones(N, M, dtype=torch.bool, device=q.device).tril()
        if mask == "masked_fill_tril":
            s = s.masked_fill(~allowed, float("-inf"))
        elif mask == "masked_fill_triu_finfo":
            s = s.masked_fill(torch.triu(torch.ones(N, M, device=q.device), diagonal=1).bool(),
                              torch.finfo(s.dtype).min)
        elif mask == "ones_tril_eq0":
            s = s.masked_fill(torch.tril(torch.ones(N, M, device=q.device)) == 0, float("-inf"))
        elif mask == "where_arange":
            rows = torch.arange(N, device=q.device)[:, None]
            cols = torch.arange(M, device=q.device)[None, :]
            s = torch.where(cols <= rows, s, torch.tensor(float("-inf"), device=q.device))
        elif mask == "where_arange_gt":
            i = torch.arange(N, device=q.device).view(1, 1, N, 1)
            j = torch.arange(M, device=q.device).view(1, 1, 1, M)
            s = torch.where(j > i, torch.finfo(s.dtype).min, s)
        elif mask == "additive_triu":
            s = s + torch.full((N, M), float("-inf"), device=q.device).triu(1)
        elif mask == "additive_where":
            s = s + torch.where(allowed, 0.0, torch.finfo(s.dtype).min)[None, None]
        elif mask == "all_visible":  # a provably empty mask: the attention is not causal
            s = s.masked_fill(torch.zeros(N, M, dtype=torch.bool, device=q.device), float("-inf"))
            s = s + torch.zeros(N, M, device=q.device)
        elif mask == "twice":  # the same causal mask applied twice is still causal
            s = s.masked_fill(~allowed, float("-inf")) + torch.where(allowed, 0.0, float("-inf"))
        elif mask == "none":
            pass
        if scale == "div_after_mask":
            s = s / math.sqrt(D)
        if softmax == "f":
            p = F.softmax(s, dim=-1)
        elif softmax == "f_fp32":
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        elif softmax == "torch":
            p = torch.softmax(s, -1)
        elif softmax == "method_upcast":
            p = s.float().softmax(dim=-1).type_as(q)
        if dropout is not None:
            p = F.dropout(p, p=dropout[0], training=dropout[1])
        if product == "bmm":
            return torch.bmm(p.view(B * H, N, M), v.reshape(B * H, M, D)).view(B, H, N, D)
        if product == "einsum":
            return torch.einsum("bhnm,bhmd->bhnd", p, v)
        return torch.matmul(p, v)

    return fn


@pytest.mark.parametrize("product", ["matmul", "at", "mT", "permute", "bmm", "einsum"])
def test_eager_products(product):
    _check(Fn(_eager(product=product)), *_inputs(N=8, M=6))


@pytest.mark.parametrize("scale", ["mul_scores", "div_scores", "q_mul", "div_after_mask"])
def test_eager_scales(scale):
    _check(Fn(_eager(scale=scale)), *_inputs(N=6, M=8))


@pytest.mark.parametrize("mask", ["masked_fill_tril", "masked_fill_triu_finfo", "ones_tril_eq0", "where_arange",
                                  "where_arange_gt", "additive_triu", "additive_where", "all_visible", "twice",
                                  "none"])
@pytest.mark.parametrize("N, M", [(9, 5), (5, 9)])
def test_eager_masks(mask, N, M):
    _check(Fn(_eager(mask=mask)), *_inputs(N=N, M=M))


@pytest.mark.parametrize("softmax", ["f", "f_fp32", "torch", "method_upcast"])
def test_eager_softmax(softmax):
    _check(Fn(_eager(softmax=softmax)), *_inputs())


@pytest.mark.parametrize("dropout", [(0.0, True), (0.3, False)])
def test_eager_dropout_inactive(dropout):
    _check(Fn(_eager(dropout=dropout)), *_inputs())


@pytest.mark.parametrize("product", ["matmul", "bmm"])
def test_eager_repeat_kv_dropped(product):
    # the bmm spelling cannot reshape repeated heads back; plain matmul GQA is replaced with Hkv < Hq
    _check(Fn(_eager(product=product, gqa=4)), *_inputs(Hq=8, Hkv=2))


def test_repeat_kv_is_really_dropped():
    """The op reads the un-repeated k/v: no expand/reshape of k/v survives in the rewritten graph."""
    seen = {}

    def backend(gm, example_inputs):
        rewrite.run(gm, Config(reference=True))
        seen["targets"] = [n.target for n in gm.graph.nodes]
        seen["args"] = [n.args for n in gm.graph.nodes if n.target is torch.ops.tk.attention.default]
        return gm

    q, k, v = _inputs(Hq=8, Hkv=2)
    torch._dynamo.reset()
    out = torch.compile(Fn(_eager(gqa=4)), backend=backend)(q, k, v)
    torch.testing.assert_close(out, _eager(gqa=4)(q, k, v), rtol=1e-5, atol=1e-5)
    assert torch.ops.tk.attention.default in seen["targets"]
    (args,) = seen["args"]
    assert args[1].op == "placeholder" and args[2].op == "placeholder" and args[3] is True
    assert "expand" not in seen["targets"] and "softmax" not in seen["targets"]


def test_pretransposed_key_and_three_d_bmm():
    """Adapter paths: k arrives already transposed (GPT-2 legacy permute), and plain 3-D bmm attention."""

    def legacy(q, k, v):  # q, k, v as (B, N, H, D)
        kt = k.permute(0, 2, 3, 1)  # (B, H, D, M)
        s = torch.matmul(q.permute(0, 2, 1, 3), kt) / math.sqrt(q.shape[-1])
        p = s.softmax(-1)
        return torch.matmul(p, v.permute(0, 2, 1, 3))

    def single_head(q, k, v):  # (B, N, D)
        s = torch.bmm(q, k.transpose(1, 2)) * 0.25
        return torch.bmm(torch.softmax(s, dim=-1), v)

    q, k, v = (t.transpose(1, 2).contiguous() for t in _inputs(N=7, M=7))
    _check(Fn(legacy), q, k, v)
    q, k, v = (t[:, 0] for t in _inputs(N=7, M=5))
    _check(Fn(single_head), q, k, v)


def test_causal_flag_follows_the_mask():
    """The op gets causal=True exactly when the mask is causal (an all-visible mask gives False)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(m.args[3] for m in P.find(gm.graph) if m.reason is None)
        return gm

    for mask, causal in [("all_visible", False), ("none", False), ("twice", True), ("where_arange", True)]:
        seen.clear()
        torch._dynamo.reset()
        torch.compile(Fn(_eager(mask=mask)), backend=backend)(*_inputs(N=6, M=6))
        assert seen == [causal], mask


def test_causal_then_padding_mask_kept():
    def fn(q, k, v, pad):  # every mask applied must be provable, not only the first
        N = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * 0.25
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
        s = s + pad
        return s.softmax(-1) @ v

    pad = torch.zeros(2, 1, 1, 8)
    pad[0, ..., 5:] = float("-inf")
    assert "graph input" in _kept(Fn(fn), *_inputs(), pad)[0]


def test_merged_heads_output_used_directly():
    def fn(q, k, v):
        B, H, N, D = q.shape
        s = torch.bmm(q.reshape(B * H, N, D), k.reshape(B * H, -1, D).transpose(1, 2))
        p = torch.softmax(s * D ** -0.5, -1)
        return torch.bmm(p, v.reshape(B * H, -1, D)) + 1.0  # (B*H, N, D) consumed as is

    _check(Fn(fn), *_inputs(N=7, M=9))


def test_output_viewed_after_attention():
    """A `.view` of the eager (contiguous) result must keep working on the op's (B, N, H, D)-major output."""

    def fn(q, k, v):
        B, H, N, D = q.shape
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).view(B * H, N, D)

    _check(Fn(fn), *_inputs())


def test_dynamic_shapes():
    fn = Fn(_eager(mask="where_arange"))
    q, k, v = _inputs(N=8, M=8)
    torch._dynamo.mark_dynamic(q, 2)
    torch._dynamo.mark_dynamic(k, 2)
    torch._dynamo.mark_dynamic(v, 2)
    _check(fn, q, k, v)


# ---------------------------------------------------------------------------- HF transformers models

def _llama(impl, layers=2, heads=4, kv_heads=2, cache=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation=impl,
                      use_cache=cache)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class Logits(nn.Module):
    def __init__(self, model, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, ids, *extra):
        out = self.model(ids, *extra, **self.kwargs)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_training(impl):
    model = Logits(_llama(impl)).train()
    ids = torch.randint(0, 64, (2, 9))
    _check(model, ids, replaced=2, grad=True)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_inference_with_cache(impl):
    model = Logits(_llama(impl, cache=True)).eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        _check(model, ids, replaced=2, grad=False)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_decode_step(impl):
    """Prefill, then one token against the cache: q_len 1 sees every cached key (non-causal, N != M)."""
    model = _llama(impl, cache=True).eval()
    compiled = _compile(model)
    ids, nxt = torch.randint(0, 64, (2, 9)), torch.randint(0, 64, (2, 1))
    with torch.no_grad():
        got, want = compiled(ids, use_cache=True), model(ids, use_cache=True)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        got = compiled(nxt, past_key_values=got.past_key_values, use_cache=True)
        want = model(nxt, past_key_values=want.past_key_values, use_cache=True)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert tk_inductor.report().replaced["attention"] == 4, str(tk_inductor.report())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_gpt2(impl):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=32, attn_implementation=impl,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = Logits(GPT2LMHeadModel(cfg)).train()
    _check(model, torch.randint(0, 64, (2, 10)), replaced=2, grad=True)


def test_hf_gpt2_reorder_and_upcast_attn():
    """GPT-2's Megatron path: baddbmm(beta=0, alpha=scale) scores in 3-D, viewed to 4-D, 4-D value product."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=32, attn_implementation="eager",
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, reorder_and_upcast_attn=True, scale_attn_by_inverse_layer_idx=True)
    torch.manual_seed(0)
    model = Logits(GPT2LMHeadModel(cfg)).train()
    _check(model, torch.randint(0, 64, (2, 10)), replaced=2, grad=True)


def test_scores_viewed_to_other_heads_kept():
    def fn(q, k, v):  # 3-D scores viewed to (H, B) while q was (B, H): not the same pairing
        B, H, N, D = q.shape
        s = torch.bmm(q.reshape(B * H, N, D), k.reshape(B * H, N, D).transpose(1, 2)).view(H, B, N, N)
        return torch.matmul(s.softmax(-1), v)

    q, k, v = _inputs(B=2, Hq=4, Hkv=4)
    v = torch.randn(4, 2, 8, 16)
    reason = _kept(Fn(fn), q, k, v)[0]
    assert "differ from q's" in reason or "batch is broadcast" in reason, reason


def _bert(impl):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, attn_implementation=impl, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertModel(cfg).eval()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_bert_without_padding_is_full_attention(impl):
    _check(Logits(_bert(impl)), torch.randint(0, 64, (2, 10)), replaced=2, grad=False)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_bert_padding_mask_kept(impl):
    ids = torch.randint(0, 64, (2, 10))
    am = torch.ones(2, 10, dtype=torch.long)
    am[0, 7:] = 0
    reasons = _kept(Logits(_bert(impl)), ids, am)
    assert len(reasons) == 2 and all("graph input" in r for r in reasons), reasons


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_padding_mask_kept(impl):
    ids = torch.randint(0, 64, (2, 9))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0
    reasons = _kept(Logits(_llama(impl)).eval(), ids, am)
    assert len(reasons) == 2 and all("graph input" in r for r in reasons), reasons


def test_hf_llama_user_position_ids_kept():
    """User-given position ids may describe packed sequences: the mask depends on their values."""
    ids = torch.randint(0, 64, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    model = _llama("eager").eval()
    reasons = _kept(Fn(lambda i, p: model(i, position_ids=p).logits), ids, pos)
    assert all("position" in r or "graph input" in r for r in reasons), reasons


def test_hf_output_attentions_kept():
    model = _llama("eager").eval()
    reasons = _kept(Fn(lambda i: model(i, output_attentions=True).logits), torch.randint(0, 64, (2, 9)))
    assert all("used elsewhere" in r for r in reasons), reasons


# ---------------------------------------------------------------------------- must not replace

# ---------------------------------------------------------------------------- masks known only at run time

def _sdpa_sliced_mask(q, k, v, m):  # transformers slices the mask handed to each layer to the key length
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m[..., : k.shape[-2]])


def _eager_added_mask(q, k, v, m):
    s = (q @ k.transpose(-1, -2)) * 0.25 + m
    return F.softmax(s.float(), dim=-1).to(q.dtype) @ v


def _masks(n: int, m: int) -> dict:
    causal = torch.ones(n, m, dtype=torch.bool).tril()
    pad = causal.clone()
    pad[:, 0] = False
    pad[:, 1] = True  # no empty rows
    neg = torch.finfo(torch.float32).min
    return {"causal": causal, "full": torch.ones(n, m, dtype=torch.bool), "padding": pad,
            "random": torch.rand(n, m) > 0.3,
            "causal_additive": torch.zeros(n, m).masked_fill(~causal, neg),
            "padding_additive": torch.zeros(n, m).masked_fill(~pad, neg), "bias": torch.randn(n, m)}


@pytest.mark.parametrize("form", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["causal", "full", "padding", "random", "causal_additive", "padding_additive", "bias"])
def test_graph_input_mask_checked_at_run_time(form, kind):
    """A mask handed into the graph (DDP/FSDP graph splits, per-layer compile) goes to tk::attention_masked,
    which equals the original graph, forward and gradients, whatever the mask's values."""
    mask = _masks(8, 8)[kind]
    if form == "eager" and mask.dtype == torch.bool:
        pytest.skip("eager attention adds float masks")
    fn = _sdpa_sliced_mask if form == "sdpa" else _eager_added_mask
    qkv = [x.requires_grad_() for x in _inputs()]
    out = _compile(Fn(fn))(*qkv, mask)
    assert tk_inductor.report().replaced == {"attention": 1}, str(tk_inductor.report())
    ref = fn(*qkv, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * w).sum(), qkv), torch.autograd.grad((ref * w).sum(), qkv)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_learned_bias_input_kept():
    bias = torch.randn(4, 8, 8, requires_grad=True)
    assert "requires grad" in _kept(Fn(_eager_added_mask), *_inputs(), bias)[0]


def test_mask_kind():
    masks = _masks(5, 7)
    kinds = {name: A.mask_kind(m, 5, 7) for name, m in masks.items()}
    assert kinds == {"causal": "causal", "full": "full", "padding": None, "random": None,
                     "causal_additive": "causal", "padding_additive": None, "bias": None}
    # broadcast views, leading dims, and an in-place change after the answer was cached
    m = masks["causal"][None, None].expand(3, 4, 5, 7)
    assert A.mask_kind(m, 5, 7) == "causal"
    owner = masks["causal"].clone()
    assert A.mask_kind(owner[None, None], 5, 7) == "causal"
    owner[4, 0] = False
    assert A.mask_kind(owner[None, None], 5, 7) is None
    assert A.mask_kind(masks["causal_additive"] * 0.5, 5, 7) == "causal"  # still 0 / <= fp16 min
    assert A.mask_kind(masks["causal_additive"] / 1e35, 5, 7) is None  # hidden values too mild


def _fresh_paths():
    A.masked_paths.clear()
    return A.masked_paths


@pytest.mark.parametrize("make, kind", [
    (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril(), "causal"),
    (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
     .expand(q.shape[0], 1, -1, -1), "causal"),
    (lambda q: torch.where(torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril(), 0.0, float("-inf")), "causal"),
    (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool), "full"),
    (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(), None),  # anti-causal: values decide
    (lambda q: q[0, 0] > 0, None),  # from the data
])
def test_mask_made_by_another_graph_is_proven(make, kind):
    """A mask output by one compiled graph (as across DDP's graph splits) carries its proof to the graph that
    takes it as input: its kind is known without reading its values; other outputs carry none."""
    q = _inputs()[0]
    paths = _fresh_paths()
    mask = _compile(Fn(lambda x: (make(x), x * 2)))(q)[0]
    n = q.shape[2]
    view = mask[..., :n - 1]  # transformers slices the mask to the key length
    got = A.mask_kind(view, n, n - 1)
    assert paths["proven"] == (kind is not None) and paths["value checks"] == (kind is None)
    if kind is not None:
        assert got == kind
        A._kinds.clear()
        A._proofs.clear()
        assert A.mask_kind(view, n, n - 1) == got  # the values agree with the proof


def test_mask_proof_crosses_ddp_graph_split(monkeypatch):
    """Under DDP's graph splitting (DDPOptimizer, one bucket per parameter), the mask made in one submodule
    reaches the attention of the next as an input, with its proof: its kind is known without its values."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    from tk_inductor import backend

    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, q, k, v):
            n = q.shape[2]
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            o = F.scaled_dot_product_attention(self.l1(q), k, v, attn_mask=mask)
            return F.scaled_dot_product_attention(self.l2(o), k, v, attn_mask=mask[..., :n])

    seen = []
    masked_path = A._masked_path

    def spy(q, k, v, mask):
        seen.append(A._proven_kind(mask, q.shape[2], k.shape[2]))
        return masked_path(q, k, v, mask)

    monkeypatch.setattr(A, "_masked_path", spy)
    tk_inductor.reset()
    torch._dynamo.reset()
    ddp = DDPOptimizer(1, lambda gm, ex: backend.thunderkittens(gm, ex, options=OPTS), first_bucket_cap=1)
    model = TwoLayers()
    q, k, v = _inputs()
    out = torch.compile(model, backend=ddp.compile_fn)(q, k, v)
    torch.testing.assert_close(out, model(q, k, v), rtol=1e-5, atol=1e-5)
    assert seen == ["causal"], seen  # the second layer's mask crossed the split, proven


def test_proven_mask_views():
    """Only views whose every plane is a top-left corner of a proven plane take the proof."""
    base = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    cases = {  # view -> taken from the proof?
        "same": (base, 6, 6, True),
        "keys sliced": (base[..., :4], 6, 4, True),
        "corner": (base[:, :, :3, :5], 3, 5, True),
        "one key": (base[..., :1], 6, 1, True),
        "heads expanded": (base.expand(2, 3, 6, 6), 6, 6, True),
        "one batch entry": (base[1:], 6, 6, False),  # another storage offset: values decide
        "rows shifted": (base[:, :, 1:], 5, 6, False),
        "transposed": (base.transpose(-1, -2), 6, 6, False),
    }
    for name, (view, n, m, proven) in cases.items():
        A._kinds.clear()
        A._proofs.clear()
        A.prove_mask(base, "causal")
        paths = _fresh_paths()
        got = A.mask_kind(view, n, m)
        assert paths["proven"] == proven, name
        A._kinds.clear()
        A._proofs.clear()
        assert A.mask_kind(view, n, m) == got, name  # the proof never disagrees with the values
    A.prove_mask(base, "causal")
    base[..., 5, 0] = False  # changed in place after the proof: values decide
    paths = _fresh_paths()
    assert A.mask_kind(base, 6, 6) is None and paths["value checks"] == 1
    with pytest.raises(ValueError, match="kind"):
        A.prove_mask(base, "padding")


def test_attention_masked_bad_mask():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="does not broadcast"):
        torch.ops.tk.attention_masked(q, k, v, torch.ones(3, 8, dtype=torch.bool), 0.25)
    with pytest.raises(TypeError, match="bool or floating"):
        torch.ops.tk.attention_masked(q, k, v, torch.ones(8, 8, dtype=torch.long), 0.25)


def test_attention_masked_opcheck():
    q, k, v = _inputs()
    torch.library.opcheck(torch.ops.tk.attention_masked.default, (q, k, v, _masks(8, 8)["padding"], 0.25))


def test_sliding_window_kept():
    def fn(q, k, v):
        N = q.shape[-2]
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        allowed = (j <= i) & (j > i - 3)
        s = (q @ k.transpose(-1, -2)) * 0.25
        return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v

    reasons = _kept(Fn(fn), *_inputs())
    assert "union" in reasons[0] or "sliding" in reasons[0], reasons


def test_sliding_window_where_kept():
    def fn(q, k, v):
        N = q.shape[-2]
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        allowed = (j <= i) & (i - j < 3)
        s = torch.where(allowed, (q @ k.transpose(-1, -2)) * 0.25, float("-inf"))
        return s.softmax(-1) @ v

    assert "sliding-window" in _kept(Fn(fn), *_inputs())[0]


def test_offset_causal_kept():
    def fn(q, k, v):  # bottom-right aligned causal (keys = cache + new tokens): not the op's top-left
        N, M = q.shape[-2], k.shape[-2]
        allowed = torch.ones(N, M, dtype=torch.bool).tril(diagonal=M - N)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    assert "diagonal offset of 3" in _kept(Fn(fn), *_inputs(N=5, M=8))[0]


def test_softcapping_kept():
    def fn(q, k, v):
        s = (q @ k.transpose(-1, -2)) * 0.25
        s = torch.tanh(s / 30.0) * 30.0
        return F.softmax(s, dim=-1) @ v

    assert any("softcapping" in r for r in _kept(Fn(fn), *_inputs()))


def test_alibi_bias_kept():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(1, 4, 1, 1)

    def fn(q, k, v):
        N = q.shape[-2]
        rel = (torch.arange(N)[None, :] - torch.arange(N)[:, None]).float()
        s = (q @ k.transpose(-1, -2)) * 0.25 + slopes * rel
        return F.softmax(s, dim=-1) @ v

    reasons = _kept(Fn(fn), *_inputs())
    assert "not provably causal" in reasons[0] or "bias" in reasons[0], reasons


def test_weak_fill_value_kept():
    def fn(q, k, v):
        N = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * 0.25
        return s.masked_fill(torch.ones(N, N).tril() == 0, -1e4).softmax(-1) @ v

    assert "does not vanish" in _kept(Fn(fn), *_inputs())[0]


def test_in_place_mask_kept():
    def fn(q, k, v):
        N = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * 0.25
        s.masked_fill_(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
        return s.softmax(-1) @ v

    assert "in place" in _kept(Fn(fn), *_inputs())[0]


def test_dropout_in_training_kept():
    torch.manual_seed(0)
    fn = Fn(_eager(dropout=(0.5, True)))
    out = _compile(fn)(*_inputs())
    report = tk_inductor.report()
    assert out.shape == (2, 4, 8, 16)
    assert report.replaced.get("attention", 0) == 0
    assert any("dropout p=0.5 in training" in r for f, r in report.kept if f == "attention")


def test_sdpa_dropout_kept():
    fn = Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
    _compile(fn)(*_inputs())
    assert any("dropout_p=0.1" in r for _, r in tk_inductor.report().kept)


def test_value_head_dim_differs_kept():
    q, k, _ = _inputs()
    v = torch.randn(2, 4, 8, 32)
    reasons = _kept(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), q, k, v)
    assert "value head dim" in reasons[0]


def test_not_replaced_outside_allowlist_or_reference():
    q, k, v = _inputs()
    fn = Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert "allowlist" in _kept(fn, q, k, v, options={**OPTS, "ops": ["rotary"]})[0]
    # without reference mode, CPU inputs have no kernel: kept for their device
    assert "device cpu" in _kept(fn, q, k, v, options={"inner": "aot_eager"})[0]


# ---------------------------------------------------------------------------- kernel-mode checks (fake CUDA values)

class QKV(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q, k, v)


def _fake_cuda_graph(fn, shapes, dtype):
    """fn traced to a torch-IR graph whose example values are fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = fx.symbolic_trace(QKV(fn))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    return gm


def _reasons(gm):
    return [m.reason for m in P.find(gm.graph)]


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def eager_causal(q, k, v):
    N = q.shape[-2]
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.125
    s = s.masked_fill(q.new_ones(N, N, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), v)


@pytest.mark.parametrize("fn", [sdpa_causal, eager_causal])
def test_kernel_mode_supported(fn):
    gm = _fake_cuda_graph(fn, [(2, 8, 16, 128), (2, 2, 16, 128), (2, 2, 16, 128)] if fn is sdpa_causal
                          else [(2, 8, 16, 64)] * 3, torch.bfloat16)
    (m,) = P.find(gm.graph)
    assert m.reason is None and m.device.type == "cuda" and not m.needs_grad
    assert m.target is torch.ops.tk.attention.default and m.args[3] is True


@pytest.mark.parametrize("fn", [sdpa_causal, eager_causal])
@pytest.mark.parametrize("dtype, D, why", [(torch.float32, 64, "dtype torch.float32"),
                                           (torch.bfloat16, 96, "head dim 96")])
def test_kernel_mode_unsupported_dtype_or_head_dim(fn, dtype, D, why):
    gm = _fake_cuda_graph(fn, [(2, 4, 16, D)] * 3, dtype)
    (reason,) = _reasons(gm)
    assert reason is not None and why in reason
    with tk_inductor.config.patch(reference=True):  # reference mode: the op's reference takes any of these
        assert _reasons(gm) == [None]


def test_heads_not_a_multiple_kept():
    """Eager code cannot produce Hq % Hkv != 0 (SDPA raises), so feed the matcher such example values."""
    gm = _fake_cuda_graph(sdpa_causal, [(2, 4, 16, 64), (2, 2, 16, 64), (2, 2, 16, 64)], torch.bfloat16)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mode = placeholders[0].meta["val"].fake_mode
    with mode:
        for n in placeholders[1:]:
            n.meta["val"] = torch.empty(2, 3, 16, 64, dtype=torch.bfloat16, device="cuda")
    (reason,) = _reasons(gm)
    assert "not a multiple" in reason


@pytest.mark.parametrize("grad", [False, True])
def test_needs_grad_and_device_from_example_values(grad):
    seen = []

    def backend(gm, example_inputs):
        seen.extend(P.find(gm.graph))
        return gm

    torch._dynamo.reset()
    q, k, v = (t.requires_grad_(grad) for t in _inputs())
    torch.compile(Fn(sdpa_causal), backend=backend)(q, k, v)
    (m,) = seen
    assert m.needs_grad is grad and m.device == torch.device("cpu") and m.reason is None


# ---------------------------------------------------------------------------- mask proofs (unit)

def _mask_graph(fn, *shapes):
    """The node computing fn's result in the Dynamo graph of fn(*zeros(shapes))."""
    seen = {}

    def backend(gm, example_inputs):
        seen["out"] = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        seen["gm"] = gm  # keep the graph alive
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*[torch.zeros(s) for s in shapes])
    return seen["out"]


@pytest.mark.parametrize("fn, expect", [
    (lambda x: torch.ones(5, 7, dtype=torch.bool).tril(), True),
    (lambda x: torch.ones(5, 7).triu(1) == 0, True),
    (lambda x: torch.arange(5)[:, None] >= torch.arange(7), True),
    (lambda x: torch.arange(7)[None, :] < torch.arange(5)[:, None] + 1, True),
    (lambda x: torch.ones(5, 7, dtype=torch.bool), False),
    (lambda x: x.new_full((5, 7), -math.inf).triu(1) == 0, True),
    (lambda x: torch.arange(start=0, end=7)[None, :] <= torch.arange(start=0, end=5)[:, None], True),
])
def test_mask_proofs(fn, expect):
    node = _mask_graph(fn, (1,))
    assert P._allowed_kind(P._as_pred(P._MaskEval()(node)), (5, 7)) is expect


@pytest.mark.parametrize("fn, why", [
    (lambda x: torch.ones(5, 7, dtype=torch.bool).tril(1), "diagonal offset"),
    (lambda x: torch.arange(5)[:, None] * 2 >= torch.arange(7), "not a plain causal"),
    (lambda x: x > 0, "graph input"),
    (lambda x: torch.rand(5, 7) > 0.5, "rand"),
])
def test_mask_refusals(fn, why):
    node = _mask_graph(fn, (5, 7))
    with pytest.raises(P.Keep, match=why):
        P._allowed_kind(P._as_pred(P._MaskEval()(node)), (5, 7))


# ============================================================================ on the GPU (skipped without CUDA)

def _kernel_built() -> bool:
    """False where the kernels cannot run (no sm_90 GPU: the caller skips). On an sm_90 GPU the kernels must load:
    a failed build fails the test with the compiler's error instead of skipping it."""
    from tk_inductor import build

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return False
    build.load("attention")
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_op_uses_kernel_and_autograd(causal):
    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in _qkv(2, 8, 2, 300, 257, 128, dtype=torch.float32))
    assert A._kernel_ok(q, k, v)
    o, lse = torch.ops.tk.attention(q, k, v, causal, 0.0883)
    ref_o, ref_lse = A.attention_reference(q.detach(), k.detach(), v.detach(), causal, 0.0883)
    assert not o.isnan().any()
    assert (o.float() - ref_o.float()).norm() / ref_o.float().norm() < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    want = A.attention_backward_reference(do, q.detach(), k.detach(), v.detach(), o.detach(), lse, causal, 0.0883)
    for g, w in zip(grads, want):
        assert (g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-3) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_unsupported_inputs_fall_back_to_reference():
    q, k, v = (t.cuda() for t in _qkv(1, 4, 4, 33, 33, 64, dtype=torch.float32))
    o, _ = torch.ops.tk.attention(q, k, v, True, 0.125)  # fp32: no kernel, the reference runs
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpu_llama_bf16_kernel_replaced(impl):
    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).cuda().bfloat16()
    ids = torch.randint(0, 128, (2, 77), device="cuda")
    compiled = _compile(model, {"inner": "aot_eager", "ops": ["attention"]})
    got = compiled(ids).logits
    report = tk_inductor.report()
    want = model(ids).logits
    assert report.replaced.get("attention") == 2, str(report)
    assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2
    got.float().square().mean().backward()  # the backward kernel runs inside autograd
    assert all(p.grad is not None and not p.grad.isnan().any() for p in model.parameters() if p.requires_grad)


def _random_mask_fn(rng):
    """A random boolean mask spelled with the ops the prover models, and its concrete evaluation."""
    N, M = rng.randint(1, 9), rng.randint(1, 9)
    a, b, c = rng.randint(-2, 2), rng.randint(-2, 2), rng.randint(-2, 2)
    kind = rng.randrange(6)

    def fn(x):
        i = torch.arange(N)[:, None] + a
        j = torch.arange(M)[None, :] + b
        if kind == 0:
            m = j <= i + c
        elif kind == 1:
            m = i - j >= c
        elif kind == 2:
            m = torch.ones(N, M, dtype=torch.bool).tril(c)
        elif kind == 3:
            m = torch.ones(N, M).triu(c + 1) == 0
        elif kind == 4:
            m = (j <= i) & (j > i - 3 + c)
        else:
            m = ~(j > i + c) & (torch.zeros(N, M) == 0)
        return m.view(1, 1, N, M).expand(2, 1, N, M)

    return fn, (N, M)


def test_mask_prover_is_sound_on_random_masks():
    """Whatever the prover concludes must hold on the concrete mask (soundness), and every one of these
    spellings that is concretely causal or all-visible on its box is proven (completeness here)."""
    import random

    rng = random.Random(0)
    proven = 0
    for _ in range(60):
        fn, (N, M) = _random_mask_fn(rng)
        concrete = fn(torch.zeros(1))[0, 0]
        node = _mask_graph(fn, (1,))
        try:
            causal = P._allowed_kind(P._as_pred(P._MaskEval()(node)), (2, 4, N, M))
        except P.Keep as e:
            assert not torch.equal(concrete, torch.ones(N, M, dtype=torch.bool).tril()), (N, M, str(e))
            assert not concrete.all(), (N, M, str(e))
            continue
        proven += 1
        expected = torch.ones(N, M, dtype=torch.bool).tril() if causal else torch.ones(N, M, dtype=torch.bool)
        assert torch.equal(concrete, expected), (N, M, causal, concrete)
    assert proven >= 15  # most random spellings of causal/all-visible masks are proven, not refused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["causal", "full", "padding", "causal_additive", "bias"])
def test_gpu_attention_masked_paths(kind):
    """A causal or all-visible run-time mask runs the kernel (lse computed), any other runs SDPA; forward and
    gradients equal SDPA with the mask either way; one check per mask tensor (cached)."""
    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    N = M = 300
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in _qkv(2, 8, 2, N, M, 128, dtype=torch.float32))
    mask = _masks(N, M)[kind].cuda()
    if mask.is_floating_point():
        mask = mask.bfloat16()
    o, lse = torch.ops.tk.attention_masked(q, k, v, mask[None, None], 0.0883)
    assert (lse.abs().sum() > 0) == (kind in ("causal", "full", "causal_additive"))  # which path ran
    assert A.mask_kind(mask[None, None], N, M) == {"causal": "causal", "full": "full",
                                                   "causal_additive": "causal"}.get(kind)
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    ref = F.scaled_dot_product_attention(q.float(), kk.float(), vv.float(),
                                         attn_mask=mask if mask.dtype == torch.bool else mask.float(), scale=0.0883)
    assert (o.float() - ref).norm() / ref.norm() < 1e-2
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do.float())
    for g, w in zip(got, want):
        assert (g.float() - w.float()).norm() / w.float().norm() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_attention_masked_under_cuda_graph_capture_takes_sdpa_path():
    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    q, k, v = (t.cuda().bfloat16() for t in _qkv(1, 4, 4, 64, 64, 64, dtype=torch.float32))
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    torch.ops.tk.attention_masked(q, k, v, mask, 0.125)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = torch.ops.tk.attention_masked(q, k, v, mask, 0.125)
    mask[10, 0] = False  # the captured graph must honour the new values: it runs SDPA with the mask
    graph.replay()
    torch.cuda.synchronize()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    torch.testing.assert_close(o, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_per_layer_compile(impl):
    """torch.compile per decoder layer (as torchtitan/FSDP2 users do): each layer's graph receives the mask built
    outside it, so it is checked at run time; the model equals eager, forward and gradients."""
    model = _llama(impl).eval()
    ids = torch.randint(0, 64, (2, 9))
    want = model(ids).logits
    tk_inductor.reset()
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend="thunderkittens", options=OPTS)
    got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    report = tk_inductor.report()
    assert report.replaced.get("attention", 0) >= 1 and not [r for f, r in report.kept if f == "attention"], str(report)


def test_attention_masked_warns_once_when_the_kernel_cannot_take_the_mask(monkeypatch):
    """Where the kernel would run but the mask is general, the SDPA fallback says so, once."""
    monkeypatch.setattr(A, "_kernel_ok", lambda *tensors: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(A, "masked_paths", __import__("collections").Counter())
    monkeypatch.setattr(A, "_warned_sdpa", False)
    q, k, v = _inputs()
    masks = _masks(8, 8)
    with pytest.warns(UserWarning, match="neither causal nor all-visible"):
        out, _ = torch.ops.tk.attention_masked(q, k, v, masks["padding"], 0.25)
    torch.testing.assert_close(out, A._masked_sdpa(q, k, v, masks["padding"], 0.25))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.ops.tk.attention_masked(q, k, v, masks["random"], 0.25)  # said already
    assert A.masked_paths["sdpa"] == 2 and A.masked_paths["value checks"] == 2
