"""Attention sinks (gpt-oss) and the gradient of tk::attention's lse on the CPU: lse's gradient against logsumexp's
autograd, the sink formula o·σ(lse − sink) against softmax over the concatenated logits, the kernel path's
arguments with the raw kernels stood in for by the reference, and the matcher on gpt-oss's eager spelling (with the
stable softmax's row-max shift, also without sinks)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor.ops import attention as A

from attention_helpers import _check, _kept, _qkv, _inputs, Fn, stand_in_kernels


def _cat_reference(q, k, v, scale, sink, causal=True):
    """softmax over [scores, sink] with the sink's column dropped (gpt-oss's eager attention)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    logits = torch.cat([s, sink.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1).to(s.dtype)], -1)
    return logits.softmax(-1)[..., :-1] @ v


def test_lse_gradient_is_logsumexps():
    q, k, v = _qkv(2, 4, 2, 7, 9, 8, grad=True)
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.3)
    g_o, g_lse = torch.randn_like(o), torch.randn_like(lse)
    got = torch.autograd.grad((o, lse), (q, k, v), (g_o, g_lse))
    ref_o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    ref_lse = s.masked_fill(~torch.ones(7, 9, dtype=torch.bool).tril(), float("-inf")).logsumexp(-1)
    want = torch.autograd.grad((ref_o, ref_lse), (q, k, v), (g_o, g_lse.double()), retain_graph=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # P from the fp32 lse
    # lse alone
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.3)
    got = torch.autograd.grad(lse, (q, k, v), g_lse)
    want = torch.autograd.grad(ref_lse, (q, k), g_lse.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not got[2].any()  # lse does not depend on v


@pytest.mark.parametrize("causal", [False, True])
def test_sink_adapter_is_the_cat_softmax(causal):
    q, k, v = _qkv(2, 4, 2, 6, 6, 8, grad=True)
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = A.attention_sink_adapter(q, k, v, causal, 0.4, 0, 0.0, sink.reshape(1, -1, 1, 1).expand(2, 4, 6, 1),
                                   (False, False, False))
    want = _cat_reference(q, k, v, 0.4, sink, causal)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, sink), g), torch.autograd.grad(want, (q, k, v, sink), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_path_passes_lse_gradient(monkeypatch):
    """With the kernels (stood in for by the reference), the backward op hands lse's gradient to the raw op."""
    seen = []
    stand_in_kernels(monkeypatch, seen)
    q, k, v = (t.bfloat16().requires_grad_() for t in _qkv(1, 4, 2, 33, 33, 64, dtype=torch.float32))
    sink = torch.randn(4, requires_grad=True)
    out = A.attention_sink_adapter(q, k, v, True, 0.125, 0, 0.0, sink.reshape(1, -1, 1, 1), (False, False, False))
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sink), g)
    assert len(seen) == 1 and seen[0] is not None and seen[0].dtype == torch.float32 and seen[0].is_contiguous()
    want_out = _cat_reference(*(t.detach().float().requires_grad_() for t in (q, k, v)), 0.125, sink.detach())
    torch.testing.assert_close(out.float(), want_out, rtol=2e-2, atol=2e-2)
    assert all(t is not None and t.isfinite().all() for t in got)


class SinkAttention(nn.Module):
    """gpt-oss's eager attention (transformers): GQA by repeat_kv, an additive causal mask, the sinks' logits
    concatenated, the row max subtracted, softmax, the sink's column dropped, dropout, the cast to v's dtype."""

    def __init__(self, heads=4, kv_heads=2, window=0):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(heads))
        self.heads, self.kv_heads, self.window = heads, kv_heads, window

    def forward(self, q, k, v):
        B, H, N, D = q.shape
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, 1) for t in (k, v))
        s = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        allowed = (j <= i) & ((i - j < self.window) if self.window else True)
        s = s + torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, N, -1)
        logits = torch.cat([s, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)
        w = F.dropout(probs[..., :-1], p=0.0, training=self.training).to(v.dtype)
        return torch.matmul(w, v)


@pytest.mark.parametrize("window", [0, 3])
def test_gpt_oss_sinks_are_replaced(window):
    q, k, v = _inputs(Hq=4, Hkv=2)
    report = _check(SinkAttention(window=window), q, k, v)
    assert report.replaced == {"attention": 1}, str(report)


def test_stable_softmax_shift_is_replaced():
    def fn(q, k, v):
        s = (q @ k.transpose(-1, -2)) * 0.25
        s = s.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
        return (s - s.amax(-1, keepdim=True)).softmax(-1) @ v

    _check(Fn(fn), *_inputs())


def test_sink_forms_that_are_kept():
    def masked_after_the_cat(q, k, v):  # a mask on the wider logits would also hide or shift the sink's column
        s = q @ k.transpose(-1, -2) * 0.25
        logits = torch.cat([s, torch.zeros(2, 4, 8, 1)], -1)
        logits = logits + torch.zeros(9)
        return logits.softmax(-1)[..., :-1] @ v

    assert "after the attention sinks' logits" in _kept(Fn(masked_after_the_cat), *_inputs())[0]

    def max_used_elsewhere(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        logits = torch.cat([s, torch.zeros(2, 4, 8, 1)], -1)
        m = logits.max(dim=-1, keepdim=True).values
        return (logits - m).softmax(-1)[..., :-1] @ v + m

    assert "row max is also used elsewhere" in _kept(Fn(max_used_elsewhere), *_inputs())[0]


def test_sinks_kept_column_is_not_attention():
    """Without the slice that drops the sink's column the weights are not attention's: nothing is replaced."""
    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        p = torch.cat([s, torch.zeros(2, 4, 8, 1)], -1).softmax(-1)
        return p[..., 1:] @ v

    tk_inductor.reset()
    torch._dynamo.reset()
    out = torch.compile(Fn(fn), backend="thunderkittens", options={"reference": True, "inner": "aot_eager"})(*_inputs())
    torch.testing.assert_close(out, fn(*_inputs()))
    assert not tk_inductor.report().replaced.get("attention")


def test_sdpa_lse_is_unchanged_by_the_sinks_math():
    """math check of the identity the adapter uses: softmax([s, c])[:-1] = softmax(s)·σ(logsumexp(s) − c)."""
    s, c = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    left = torch.cat([s, c], -1).softmax(-1)[:, :-1]
    right = s.softmax(-1) * torch.sigmoid(s.logsumexp(-1, keepdim=True) - c)
    torch.testing.assert_close(left, right)
    assert math.isclose(float((left.sum(-1) + torch.cat([s, c], -1).softmax(-1)[:, -1]).mean()), 1.0)


def _masked_reference(q, k, v, scale, allowed):
    """(o, lse) of softmax attention under a bool (N, M) or (B, 1, N, M) mask, GQA by repeating k and v."""
    group = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return s.softmax(-1).nan_to_num(0.0) @ v.repeat_interleave(group, 1), s.logsumexp(-1)


@pytest.mark.parametrize("kind", ["causal", "arbitrary"])
def test_masked_op_lse_and_its_gradient(kind):
    """tk::attention_masked with with_lse: lse equals logsumexp over the visible scores on the kernel path's kinds
    (causal) and on the fallback's (any other mask: the reference formulas), and lse's gradient reaches q and k."""
    q, k, v = _qkv(2, 4, 2, 7, 7, 8, grad=True)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()
    if kind == "arbitrary":
        allowed = allowed & (torch.arange(7)[None, :] != 2)
    o, lse = torch.ops.tk.attention_masked(q, k, v, allowed, 0.3, 0.0, True)
    ref_o, ref_lse = _masked_reference(q, k, v, 0.3, allowed)
    torch.testing.assert_close(o, ref_o, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    g_o, g_lse = torch.randn_like(o), torch.randn_like(lse)
    got = torch.autograd.grad((o, lse), (q, k, v), (g_o, g_lse))
    want = torch.autograd.grad((ref_o, ref_lse), (q, k, v), (g_o, g_lse.double()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_varlen_op_lse_gradient():
    """tk::attention_varlen's lse is differentiable: its gradient (through the backward's grad_lse) matches the
    dense reference's under a padding mask, rows without keys included (lse +inf, no gradient)."""
    q, k, v = _qkv(2, 4, 2, 9, 9, 8, grad=True)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :4] = False  # left padding: the first rows see no key under the causal mask
    o, lse = torch.ops.tk.attention_varlen(q, k, v, keep, None, True, 0.3)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril() & keep[:, None, None, :]
    ref_o, ref_lse = _masked_reference(q, k, v, 0.3, allowed)
    seen = ref_lse.isfinite()
    torch.testing.assert_close(o, ref_o, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], rtol=1e-6, atol=1e-6)
    g_lse = torch.randn_like(lse).masked_fill(~seen, 0.0)
    got = torch.autograd.grad(lse, (q, k), g_lse)
    want = torch.autograd.grad(ref_lse.masked_fill(~seen, 0.0), (q, k), g_lse.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class MaskedSinkAttention(SinkAttention):
    """gpt-oss's eager attention with its additive mask handed in (a decode step's, as transformers passes it)."""

    def forward(self, q, k, v, mask):
        B, H, N, D = q.shape
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, 1) for t in (k, v))
        s = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + mask
        logits = torch.cat([s, self.sinks.reshape(1, -1, 1, 1).expand(B, -1, N, -1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        w = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v.dtype)
        return torch.matmul(w, v)


@pytest.mark.parametrize("kind", ["causal", "arbitrary"])
def test_sinks_under_a_mask_handed_in(kind):
    """Sinks under a mask the graph takes as an input run as tk::attention_masked's o and lse rescaled, forward and
    gradients (q, k, v and the sinks) equal to eager: a causal mask (the kernel path's kind) and another (the
    fallback's reference formulas)."""
    from attention_helpers import _compile

    allowed = torch.ones(8, 8, dtype=torch.bool).tril()
    if kind == "arbitrary":
        allowed = allowed & (torch.arange(8)[None, :] != 1) | torch.eye(8, dtype=torch.bool)
    mask = torch.zeros(8, 8).masked_fill(~allowed, torch.finfo(torch.float32).min)
    model = MaskedSinkAttention()
    qkv = [x.requires_grad_() for x in _inputs(Hq=4, Hkv=2)]
    out = _compile(model)(*qkv, mask)
    assert tk_inductor.report().replaced == {"attention": 1}, str(tk_inductor.report())
    ref = model(*qkv, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(ref)
    leaves = [*qkv, model.sinks]
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "runs"])
def test_masked_kernel_paths_pass_lse_gradient(monkeypatch, kind):
    """tk::attention_masked's kernel paths (the raw kernels stood in for by the reference) hand lse's gradient to the
    raw backward: a causal mask through tk::attention, a mask of one run of keys per row through the interval
    tables (row_keys forward, key_rows backward); sinks on top equal the cat-softmax reference."""
    seen = []
    stand_in_kernels(monkeypatch, seen)
    from tk_inductor.ops.attention_masked import attention_masked_sink_adapter

    q, k, v = (t.bfloat16().requires_grad_() for t in _qkv(2, 4, 2, 9, 9, 64, dtype=torch.float32))
    allowed = torch.ones(9, 9, dtype=torch.bool).tril()
    if kind == "runs":  # each row one run of keys, not a kernel kind: the interval tables
        allowed = allowed & (torch.arange(9)[None, :] >= torch.arange(9)[:, None] // 2)
    sink = torch.randn(4, requires_grad=True)
    out = attention_masked_sink_adapter(q, k, v, allowed, 0.125, 0.0, sink.reshape(1, -1, 1, 1))
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sink), g)
    assert len(seen) == 1 and seen[0] is not None

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    s = (qf @ kf.repeat_interleave(2, 1).transpose(-1, -2)) * 0.125
    logits = torch.cat([s.masked_fill(~allowed, float("-inf")), sink.reshape(1, -1, 1, 1).expand(2, 4, 9, 1)], -1)
    want_out = logits.softmax(-1)[..., :-1] @ vf.repeat_interleave(2, 1)
    torch.testing.assert_close(out.float(), want_out, rtol=2e-2, atol=2e-2)
    for a, b in zip(got, torch.autograd.grad(want_out, (qf, kf, vf, sink), g.float())):
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)
