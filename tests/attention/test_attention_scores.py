"""Attention family: the score modifications on the CPU. The op's sliding window and softcap (reference semantics
and gradients against plain fp64 formulas, argument checks) and the matcher's proofs of them (masks spelled as
transformers and hand-written code spell them, Gemma-2's `tanh` capping), with what stays kept."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tk_inductor.ops.attention  # noqa: F401  (registers the tk:: ops)
from tk_inductor import rewrite
from tk_inductor.config import Config

from attention_helpers import _inputs, _kept, _qkv, Fn


def plain(q, k, v, scale, window=0, softcap=0.0):
    """Causal attention written out, with the window as transformers builds it (key j visible when i - window < j)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    N, M = s.shape[-2:]
    i, j = torch.arange(N)[:, None], torch.arange(M)[None, :]
    allowed = (j <= i) & ((j > i - window) if window else True)
    return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (3, 0.0), (8, 0.0), (50, 0.0), (0, 2.0), (4, 0.7)])
@pytest.mark.parametrize("N, M", [(9, 9), (5, 12)])
def test_op_matches_the_formula_and_its_gradients(window, softcap, N, M):
    q, k, v = _qkv(2, 4, 2, N, M, 8, grad=True)
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.4, window, softcap)
    o_ref = plain(q, k, v, 0.4, window, softcap)
    torch.testing.assert_close(o, o_ref)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    for g, r in zip(grads, grads_ref):  # the backward reads the forward's lse, fp32
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_op_opcheck():
    q, k, v = _qkv(1, 2, 2, 6, 6, 8, dtype=torch.float32, grad=True)
    torch.library.opcheck(torch.ops.tk.attention.default, (q, k, v, True, 0.3, 3, 5.0))
    o, lse = torch.ops.tk.attention(q.detach(), k.detach(), v.detach(), True, 0.3, 3, 5.0)
    torch.library.opcheck(torch.ops.tk.attention_backward.default,
                          (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse, True, 0.3, 3, 5.0))


@pytest.mark.parametrize("causal, window, softcap, error, message", [
    (False, 4, 0.0, ValueError, "needs causal=True"),
    (True, -1, 0.0, TypeError, "window must be an int >= 0"),
    (True, 0, -1.0, ValueError, "softcap must be a finite number >= 0"),
    (True, 0, math.nan, ValueError, "softcap must be a finite number >= 0"),
])
def test_op_argument_errors(causal, window, softcap, error, message):
    q, k, v = _qkv(1, 2, 2, 4, 4, 8)
    with pytest.raises(error, match=message):
        torch.ops.tk.attention(q, k, v, causal, 0.3, window, softcap)


# ---------------------------------------------------------------------------- the matcher

def _replaced_args(model, *inputs):
    """The rewrite in reference mode: the output equals eager, and the one attention is replaced; its op arguments
    after q, k, v (causal, scale, window, softcap)."""
    seen = {}

    def backend(gm, example_inputs):
        rewrite.run(gm, Config(reference=True))
        seen["args"] = [n.args for n in gm.graph.nodes if n.target is torch.ops.tk.attention.default]
        return gm

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(*inputs)
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
    (args,) = seen["args"]
    return args[3:]


def _window_masked_fill(q, k, v):
    N = q.shape[-2]
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    allowed = (j <= i) & (j > i - 3)
    s = (q @ k.transpose(-1, -2)) * 0.25
    return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def _window_where(q, k, v):
    N = q.shape[-2]
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    allowed = (j <= i) & (i - j < 3)
    return torch.where(allowed, (q @ k.transpose(-1, -2)) * 0.25, float("-inf")).softmax(-1) @ v


def _window_sdpa_tril(q, k, v):  # tril minus a lower tril: the window as two triangles
    N = q.shape[-2]
    ones = torch.ones(N, N, dtype=torch.bool)
    mask = ones.tril() & ~ones.tril(-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)


def _window_twice(q, k, v):  # a causal mask, then a window mask: the intersection
    N = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * 0.25
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    s = s + torch.where((i - j) >= 5, torch.finfo(s.dtype).min, 0.0)
    return s.softmax(-1) @ v


@pytest.mark.parametrize("fn, window", [(_window_masked_fill, 3), (_window_where, 3), (_window_sdpa_tril, 3),
                                        (_window_twice, 5)])
def test_sliding_windows_are_replaced(fn, window):
    causal, scale, w, cap = _replaced_args(Fn(fn), *_inputs())
    assert causal is True and scale == 0.25 and w == window and cap == 0.0


def test_window_wider_than_the_scores_is_plain_causal():
    causal, _, w, _ = _replaced_args(Fn(_window_masked_fill), *_inputs(N=3, M=3))
    assert causal is True and w == 0


def _gemma2_scores(q, k, v, cap=50.0, mask=True):  # transformers' Gemma-2 eager attention
    s = torch.matmul(q, k.transpose(2, 3)) * 0.125
    s = s / cap
    s = torch.tanh(s)
    s = s * cap
    if mask:
        N = q.shape[-2]
        i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        s = s + torch.where((j <= i) & (j > i - 4), 0.0, torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def test_softcap_is_replaced():
    q, k, v = _inputs(D=64)
    causal, scale, w, cap = _replaced_args(Fn(_gemma2_scores), q * 8, k * 8, v)  # scores large enough to cap
    assert causal is True and w == 4 and cap == 50.0 and scale == pytest.approx(0.125)


def test_softcap_without_a_mask():
    causal, scale, w, cap = _replaced_args(Fn(lambda q, k, v: _gemma2_scores(q, k, v, cap=2.0, mask=False)), *_inputs())
    assert causal is False and w == 0 and cap == 2.0 and scale == pytest.approx(0.125)


@pytest.mark.parametrize("fn, why", [
    (lambda q, k, v: torch.tanh(q @ k.transpose(-1, -2)).softmax(-1) @ v, "without a multiplication by the cap"),
    (lambda q, k, v: (torch.tanh((q @ k.transpose(-1, -2)).masked_fill(
        torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf")) / 5) * 5).softmax(-1) @ v,
     "masked before the softcap"),
    (lambda q, k, v: (torch.tanh(q @ k.transpose(-1, -2) / 5) * 5 * 0.5).softmax(-1) @ v, "scaled again"),
    (lambda q, k, v: (q @ k.transpose(-1, -2)).masked_fill(
        (torch.arange(8)[:, None] - torch.arange(8)[None, :] >= 3) | (torch.arange(8)[None, :] > torch.arange(8)[:, None] + 2),
        float("-inf")).softmax(-1) @ v, "mask"),  # a two-sided (non-causal) window
])
def test_kept_score_forms(fn, why):
    reasons = _kept(Fn(fn), *_inputs())
    assert why in reasons[0], reasons


# ---------------------------------------------------------------------------- two-sided windows (encoders)

def _two_sided_sdpa(q, k, v):  # transformers' bidirectional sliding window (ModernBERT's local attention), as SDPA
    N = q.shape[-2]
    band = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).abs() <= 2
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=0.25)


def _two_sided_eager(q, k, v):  # eager attention with the finite fill of transformers' eager masks
    N = q.shape[-2]
    band = (torch.arange(N)[None, :] - torch.arange(N)[:, None]).abs() <= 2
    s = (q @ k.transpose(-1, -2)) * 0.25 + torch.where(band, 0.0, torch.finfo(torch.float32).min)
    return s.softmax(-1) @ v


def _two_sided_masked_fill(q, k, v):
    N = q.shape[-2]
    hidden = torch.abs(torch.arange(N)[:, None] - torch.arange(N)[None, :]) > 2
    return (q @ k.transpose(-1, -2) * 0.25).masked_fill(hidden, float("-inf")).softmax(-1) @ v


def _varlen_call(model, *inputs):
    """As _replaced_args, for the matches that run on interval tables: the varlen adapter's arguments."""
    from tk_inductor.ops import attention_varlen as AV

    seen = {}

    def backend(gm, example_inputs):
        rewrite.run(gm, Config(reference=True))
        seen["args"] = [n.args for n in gm.graph.nodes if n.target is AV.attention_varlen_adapter]
        return gm

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(*inputs)
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
    (args,) = seen["args"]
    return args


def _varlen_args(model, *inputs):
    """The varlen adapter's (causal, scale, window)."""
    args = _varlen_call(model, *inputs)
    return args[3], args[4], args[5]


@pytest.mark.parametrize("fn", [_two_sided_sdpa, _two_sided_eager, _two_sided_masked_fill])
def test_two_sided_windows_are_replaced(fn):
    """A two-sided window (each query sees the keys within 2 of it) runs on interval tables: tk::attention_varlen
    with causal=False and window 3; outputs and gradients equal eager's."""
    from attention_helpers import _check

    assert _varlen_args(Fn(fn), *_inputs()) == (False, 0.25, 3)
    _check(Fn(fn), *_inputs())


def test_two_sided_window_with_rows_past_the_keys_is_kept():
    def cross(q, k, v):  # 8 queries on 4 keys: rows from 7 on see no key within 2
        band = (torch.arange(8)[:, None] - torch.arange(4)[None, :]).abs() <= 2
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=0.25)

    q, k, v = _inputs()
    reasons = _kept(Fn(cross), q, k[:, :, :4], v[:, :, :4])
    assert "two-sided window with rows that may see no key" in reasons[0], reasons


# ---------------------------------------------------------------------------- chunked attention (Llama-4)

def _chunked_sdpa(q, k, v):
    N = q.shape[-2]
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    mask = (j <= i) & (i // 3 == j // 3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)


def test_chunked_attention_is_replaced():
    """Chunks of 3 over 8 positions run as packed sequences of the chunks (tk::attention_varlen's segments, built by
    the adapter): forward and gradients equal eager's."""
    from attention_helpers import _check

    args = _varlen_call(Fn(_chunked_sdpa), *_inputs())
    assert args[3] is True and args[-4:] == (3, False, None, ())  # causal, chunk 3 from position 0, no sinks, blocks
    _check(Fn(_chunked_sdpa), *_inputs())
