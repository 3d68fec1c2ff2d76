"""tk::attention_varlen on the CPU (the reference path): semantics against SDPA and eager softmax with the dense
mask (key padding, packed sequences, both), the interval tables the kernels get, bad inputs, opcheck."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tk_inductor.ops.attention  # noqa: F401  (registers the ops)
from tk_inductor.ops import attention_varlen as AV


def _qkv(B=3, Hq=4, Hkv=2, N=9, M=9, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for H, S in ((Hq, N), (Hkv, M), (Hkv, M))]


def _keep(M=9):
    keep = torch.zeros(3, M, dtype=torch.bool)
    keep[0, :5] = True  # right padding
    keep[1, 3:] = True  # left padding
    keep[2, 1:4] = keep[2, 6:] = True  # holes
    return keep


def _segments():
    return torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5], [0, 1, 1, 1, 7, 7, 3, 3, 3]])


def _dense(keep, segments, N, M, causal, window=0, B=3):
    allowed = torch.ones(B, 1, N, M, dtype=torch.bool)
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    if segments is not None:  # runs of equal ids (every run here has its own id)
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])[:, None]
    if causal:
        tri = torch.ones(N, M, dtype=torch.bool).tril()
        allowed = allowed & (tri.triu(1 - window) if window else tri)
    elif window:  # two-sided: |i - j| < window
        allowed = allowed & torch.ones(N, M, dtype=torch.bool).tril(window - 1).triu(1 - window)
    return allowed


def _rep(t):
    return t.repeat_interleave(2, dim=1)


@pytest.mark.parametrize("masks", ["keep", "segments", "both", "none"])
@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 3), (False, 3)])
def test_matches_sdpa_with_the_dense_mask(masks, causal, window):
    """SDPA with the dense mask as attn_mask, empty rows 0 (SDPA's safe softmax), gradients included."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    keep = _keep() if masks in ("keep", "both") else None
    segments = _segments() if masks in ("segments", "both") else None
    o, lse = torch.ops.tk.attention_varlen(q, k, v, keep, segments, causal, 0.3, window)
    dense = _dense(keep, segments, 9, 9, causal, window)
    want = F.scaled_dot_product_attention(q, _rep(k), _rep(v), attn_mask=dense, scale=0.3)
    torch.testing.assert_close(o, want)
    w = torch.randn_like(want)
    got = torch.autograd.grad((o * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    empty = ~dense.expand(3, 4, 9, 9).any(-1)
    assert torch.isinf(lse[empty]).all() and (lse[empty] > 0).all() and torch.isfinite(lse[~empty]).all()


def test_uniform_empty_is_eager_with_a_finite_fill():
    q, k, v = (t.requires_grad_() for t in _qkv())
    keep = _keep()
    o, _ = torch.ops.tk.attention_varlen(q, k, v, keep, None, True, 0.3, 0, 0.0, True)
    fill = torch.where(_dense(keep, None, 9, 9, True), 0.0, torch.finfo(torch.float32).min).double()
    want = torch.softmax(q @ _rep(k).transpose(-1, -2) * 0.3 + fill, -1) @ _rep(v)
    torch.testing.assert_close(o, want)
    torch.testing.assert_close(o[1, :, :3], _rep(v)[1].mean(1, keepdim=True).expand(4, 3, 8))  # rows before key 3
    got = torch.autograd.grad(o.sum(), (q, k, v))
    ref = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("with_lse", [False, True])
def test_uniform_empty_rows_on_the_kernel_path(monkeypatch, softcap, with_lse):
    """uniform_empty on the kernel path (the raw kernels stood in for by the reference, with their conventions): the
    kernel runs every entry whose tables are exact, and only the rows that see no key are recomputed over every key;
    o, lse's use and every gradient equal the eager model's finite fill. The entry with holes runs the reference."""
    from attention_helpers import stand_in_kernels

    stand_in_kernels(monkeypatch)
    q, k, v = (t.bfloat16().requires_grad_() for t in _qkv(N=9, M=9, D=64))  # what the kernels take
    keep = _keep()
    keep[0, 0] = False  # entry 0: left-padded by one and right-padded: row 0 sees no key
    before = dict(AV.varlen_paths)
    o, lse = torch.ops.tk.attention_varlen(q, k, v, keep, None, True, 0.3, 0, softcap, True)
    assert AV.varlen_paths["reference entries"] - before["reference entries"] == 1  # entry 2 (holes)
    assert AV.varlen_paths["uniform rows"] - before["uniform rows"] == 1 + 3  # entry 0 row 0, entry 1 rows 0..2
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    fill = torch.where(_dense(keep, None, 9, 9, True), 0.0, torch.finfo(torch.float32).min)
    s = qf @ _rep(kf).transpose(-1, -2) * 0.3
    s = softcap * torch.tanh(s / softcap) if softcap else s
    want_lse = torch.logsumexp(s + fill, -1)
    want = torch.softmax(s + fill, -1) @ _rep(vf)
    torch.testing.assert_close(o.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, want_lse)
    g = torch.randn_like(o)
    # lse's gradient on the rows that see no key is left out: their lse is the fill itself, where eager's logsumexp
    # gradient is a rounding artifact (exp(s - lse) = 1 for every key, not 1/M)
    g_lse = torch.randn_like(lse).masked_fill(fill.amax(-1).expand_as(lse) < 0, 0.0)
    outs, wants = ((o, lse), (want, want_lse)) if with_lse else ((o,), (want,))
    gs = (g, g_lse) if with_lse else (g,)
    got = torch.autograd.grad(outs, (q, k, v), gs)
    ref = torch.autograd.grad(wants, (qf, kf, vf), tuple(t.float() for t in gs))
    for a, b in zip(got, ref):  # bf16 operands: relative error over the whole gradient
        assert ((a.float() - b).norm() / b.norm()).item() < 1e-2


@pytest.mark.parametrize("masks", ["keep", "segments", "both", "none"])
@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 3), (False, 3)])
def test_interval_tables(masks, causal, window):
    """The tables hold exactly the dense mask's intervals (before a causal mask and its window, which the kernels
    apply; a two-sided window is in them): row_keys per query, key_rows per key; both nondecreasing; `exact` flags
    the entry with holes, `empty` the entries with a row that sees nothing."""
    keep = _keep() if masks in ("keep", "both") else None
    segments = _segments() if masks in ("segments", "both") else None
    if keep is None and segments is None and not (window and not causal):
        pytest.skip("no mask: tk::attention's own case")
    t = AV.Intervals(keep, segments, 9, 9, causal, window, 3, torch.device("cpu"))
    dense = _dense(keep, segments, 9, 9, False, 0 if causal else window)[:, 0]
    j = torch.arange(9)
    for b in range(3):
        exact = keep is None or bool(t.exact[b])
        for i in range(9):
            x, y = t.row_keys[b, i].tolist()
            if exact:
                assert torch.equal(dense[b, i], (j >= x) & (j <= y)), (b, i)
            x, y = t.key_rows[b, i].tolist()
            if exact:
                assert torch.equal(dense[b, :, i], (j >= x) & (j <= y)), (b, i)
        for table in (t.row_keys, t.key_rows):
            assert (table[b, 1:] >= table[b, :-1]).all()
    if keep is not None:
        assert t.exact == [True, True, False]
        rows = _dense(keep, segments, 9, 9, causal, window)[:, 0].any(-1)
        assert t.empty[:2] == [bool((~rows[b]).any()) for b in range(2)]


def test_tables_are_cached_per_tensor_and_version():
    keep = torch.ones(2, 6, dtype=torch.bool)
    before = AV.varlen_paths["table builds"]
    assert AV.intervals(keep, None, 6, 6, True, 0) is AV.intervals(keep, None, 6, 6, True, 0)
    keep[0, 4:] = False  # in place: a new version
    assert AV.intervals(keep, None, 6, 6, True, 0).row_keys[0, 0].tolist() == [0, 3]
    assert AV.varlen_paths["table builds"] - before == 2


def test_bad_inputs():
    q, k, v = _qkv(M=8)
    with pytest.raises(ValueError, match=r"keep must be \(B, M\) = \(3, 8\)"):
        torch.ops.tk.attention_varlen(q, k, v, torch.ones(3, 9, dtype=torch.bool), None, False, 0.3)
    with pytest.raises(ValueError, match="segments need as many queries as keys"):
        torch.ops.tk.attention_varlen(q, k, v, None, torch.zeros(3, 9, dtype=torch.long), False, 0.3)
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="segments must be integer"):
        torch.ops.tk.attention_varlen(q, k, v, None, torch.zeros(3, 9), False, 0.3)


def test_opcheck():
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    torch.library.opcheck(torch.ops.tk.attention_varlen.default,
                          (q, k, v, _keep(), _segments(), True, 0.3, 0, 0.0, False))


def test_window_tables_are_built_once_per_geometry():
    """A two-sided window alone has tables that depend on the geometry only: one build per (B, N, M, window), shared
    by the layers, the backward and later steps; a few geometries are kept."""
    q = torch.zeros(2, 1, 10, 8)
    first = AV.intervals(None, None, 10, 10, False, 3, q)
    assert AV.intervals(None, None, 10, 10, False, 3, q) is first
    other = AV.intervals(None, None, 10, 10, False, 4, q)
    assert other is not first
    i = torch.arange(10)
    want = torch.stack(((i - 2).clamp(min=0), (i + 2).clamp(max=9)), -1).expand(2, 10, 2)
    assert torch.equal(first.row_keys, want.to(torch.int32)) and torch.equal(first.key_rows, want.to(torch.int32))
    for w in range(5, 5 + 2 * AV._WINDOW_TABLES_KEPT):
        AV.intervals(None, None, 10, 10, False, w, q)
    assert len(AV._window_tables) <= AV._WINDOW_TABLES_KEPT
