"""tk::attention_padded on the CPU (the reference path): semantics against SDPA and eager softmax with the dense
mask, the key ranges the kernels get, which rows are empty, bad inputs, opcheck."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tk_inductor.ops.attention  # noqa: F401  (registers the ops)
from tk_inductor.ops import attention_padded as AP


def _qkv(B=3, Hq=4, Hkv=2, N=7, M=9, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for H, S in ((Hq, N), (Hkv, M), (Hkv, M))]


def _keep(M=9):
    keep = torch.zeros(3, M, dtype=torch.bool)
    keep[0, :5] = True  # right padding
    keep[1, 3:] = True  # left padding
    keep[2, 1:4] = keep[2, 6:] = True  # holes
    return keep


def _dense(keep, N, M, causal, window=0):
    allowed = keep[:, None, None, :].clone()
    if causal:
        tri = torch.ones(N, M, dtype=torch.bool).tril()
        allowed = allowed & (tri.triu(1 - window) if window else tri)
    return allowed


@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 3)])
def test_matches_sdpa_with_the_dense_mask(causal, window):
    """SDPA with keep & causal (& window) as attn_mask, empty rows 0 (SDPA's safe softmax), gradients included."""
    q, k, v = (t.requires_grad_() for t in _qkv(N=9))
    keep = _keep()
    o, lse = torch.ops.tk.attention_padded(q, k, v, keep, causal, 0.3, window)
    rep = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731
    want = F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=_dense(keep, 9, 9, causal, window), scale=0.3)
    torch.testing.assert_close(o, want)
    w = torch.randn_like(want)
    got = torch.autograd.grad((o * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    empty = ~_dense(keep, 9, 9, causal, window).expand(3, 4, 9, 9).any(-1)
    assert torch.isinf(lse[empty]).all() and (lse[empty] > 0).all() and torch.isfinite(lse[~empty]).all()


def test_uniform_empty_is_eager_with_a_finite_fill():
    q, k, v = (t.requires_grad_() for t in _qkv(N=9))
    keep = _keep()
    o, _ = torch.ops.tk.attention_padded(q, k, v, keep, True, 0.3, 0, 0.0, True)
    fill = torch.where(_dense(keep, 9, 9, True), 0.0, torch.finfo(torch.float32).min).double()
    rep = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731
    want = torch.softmax(q @ rep(k).transpose(-1, -2) * 0.3 + fill, -1) @ rep(v)
    torch.testing.assert_close(o, want)
    torch.testing.assert_close(o[1, :, :3], rep(v)[1].mean(1, keepdim=True).expand(4, 3, 8))  # rows before key 3
    got = torch.autograd.grad(o.sum(), (q, k, v))
    ref = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_key_ranges():
    keep = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0]])
    r = AP.KeyRanges(keep)
    assert r.host == [(1, 4), (0, 5), (0, 0), (0, 3)]
    assert r.exact == [True, True, True, False]
    assert r.device.dtype == torch.int32 and r.device.tolist() == [[1, 4], [0, 5], [0, 0], [0, 3]]


def test_key_ranges_are_cached_per_tensor_and_version():
    keep = torch.ones(2, 6, dtype=torch.bool)
    before = AP.padded_paths["range checks"]
    assert AP.key_ranges(keep) is AP.key_ranges(keep)
    keep[0, 4:] = False  # in place: a new version
    assert AP.key_ranges(keep).host == [(0, 4), (0, 6)]
    assert AP.padded_paths["range checks"] - before == 2


@pytest.mark.parametrize("start, end, N, causal, window, empty", [
    (0, 9, 9, True, 0, False), (2, 9, 9, True, 0, True), (2, 9, 9, False, 0, False), (0, 0, 9, False, 0, True),
    (0, 5, 9, True, 0, False), (0, 5, 9, True, 4, True), (0, 5, 9, True, 5, False), (0, 5, 0, True, 0, False)])
def test_has_empty_row(start, end, N, causal, window, empty):
    assert AP.has_empty_row(start, end, N, causal, window) == empty
    rows = _dense(torch.arange(9)[None].ge(start) & torch.arange(9)[None].lt(end), N, 9, causal, window).any(-1)
    assert bool((~rows).any()) == empty


def test_bad_inputs():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"keep must be \(B, M\) = \(3, 9\)"):
        torch.ops.tk.attention_padded(q, k, v, torch.ones(3, 8, dtype=torch.bool), False, 0.3)
    with pytest.raises(ValueError, match="sliding window"):
        torch.ops.tk.attention_padded(q, k, v, _keep(), False, 0.3, 4)
    with pytest.raises(TypeError, match="keep must be a tensor"):
        torch.ops.tk.attention_padded(q, k, v, None, False, 0.3)


def test_opcheck():
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    torch.library.opcheck(torch.ops.tk.attention_padded.default, (q, k, v, _keep(), True, 0.3, 0, 0.0, False))
