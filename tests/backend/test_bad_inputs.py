"""Odd and bad inputs to the tk:: ops, called directly (CPU, the references): a clear error naming the argument, or
the result PyTorch's own ops give. On CUDA the same Python checks run before any kernel launch."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import tk_inductor.ops.attention  # noqa: F401  (registers the ops)
import tk_inductor.ops.layernorm  # noqa: F401
import tk_inductor.ops.linear_attention  # noqa: F401
import tk_inductor.ops.ssd  # noqa: F401


@pytest.mark.parametrize("shape", [(7,), ()], ids=["per-key", "scalar"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_attention_masked_broadcasts_low_rank_masks_as_sdpa(shape, dtype):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    if dtype == torch.bool:
        mask = torch.rand(shape) > 0.3 if shape else torch.tensor(True)
        if shape:
            mask[0] = True  # every query row keeps a key
    else:
        mask = torch.randn(shape)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape)))
    o, _ = torch.ops.tk.attention_masked(q, k, v, mask, 16 ** -0.5)
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(o)
    grads = torch.ops.tk.attention_masked_backward(g, q, k, v, mask, o, torch.zeros(2, 2, 5), 16 ** -0.5)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask.reshape(
        (1,) * (2 - mask.dim()) + tuple(mask.shape))), (qr, kr, vr), g)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_attention_head_dim_zero_is_an_error():
    q = torch.randn(1, 2, 4, 0)
    for op in (lambda: torch.ops.tk.attention(q, q, q, True, 1.0),
               lambda: torch.ops.tk.attention_masked(q, q, q, torch.ones(4, 4, dtype=torch.bool), 1.0)):
        with pytest.raises(ValueError, match="head dim"):
            op()


def test_attention_empty_inputs_give_defined_outputs():
    q = torch.randn(0, 2, 4, 16)
    o, lse = torch.ops.tk.attention(q, q, q, True, 1.0)
    assert o.shape == q.shape and lse.shape == (0, 2, 4)
    q = torch.randn(1, 2, 0, 16)
    o, lse = torch.ops.tk.attention(q, torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), False, 1.0)
    assert o.shape == q.shape and lse.shape == (1, 2, 0)


@pytest.mark.parametrize("shape", [(2, 3, 0, 4), (0, 3, 5, 4), (2, 0, 5, 4)], ids=["N0", "B0", "H0"])
def test_linear_attention_empty_sizes_give_empty_outputs(shape):
    q = torch.randn(*shape, requires_grad=True)
    k = torch.randn(*shape, requires_grad=True)
    v = torch.randn(*shape[:3], 6, requires_grad=True)
    o = torch.ops.tk.linear_attention(q, k, v, "elu1", None, None, 0.5, True, 1e-6)
    assert o.shape == v.shape
    grads = torch.autograd.grad(o.sum(), (q, k, v), allow_unused=True)
    assert [g.shape if g is not None else None for g in grads] in ([q.shape, k.shape, v.shape], [None] * 3)


def test_linear_attention_backward_checks_grad_o():
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6)
    o = torch.ops.tk.linear_attention(q, k, v, "identity", None, None, 1.0, False, 0.0)
    with pytest.raises(ValueError, match="grad_o"):
        torch.ops.tk.linear_attention_backward(torch.randn(1, 2, 5, 4), q, k, v, o, "identity", None, None, 1.0,
                                               False, 0.0)


def _ssd_inputs(l=8):
    g = torch.Generator().manual_seed(0)
    b, nh, p, ng, n = 1, 2, 4, 1, 3
    x = torch.randn(b, l, nh, p, generator=g)
    dt = torch.rand(b, l, nh, generator=g) * 0.5
    A = -torch.rand(nh, generator=g)
    B, C = torch.randn(b, l, ng, n, generator=g), torch.randn(b, l, ng, n, generator=g)
    return x, dt, A, B, C


def test_ssd_chunk_longer_than_the_sequence_is_clamped():
    args = _ssd_inputs()
    start = time.perf_counter()
    y_big, s_big = torch.ops.tk.ssd(*args, None, None, 10 ** 6)
    assert time.perf_counter() - start < 5.0  # the decay matrices are not chunk² in size
    y, s = torch.ops.tk.ssd(*args, None, None, 8)
    torch.testing.assert_close(y_big, y)
    torch.testing.assert_close(s_big, s)


def test_ssd_backward_checks_its_gradients():
    x, dt, A, B, C = _ssd_inputs()
    good_state = torch.zeros(1, 2, 4, 3)
    with pytest.raises(ValueError, match="grad_y"):
        torch.ops.tk.ssd_backward(torch.zeros(1, 7, 2, 4), good_state, x, dt, A, B, C, None, None, 4)
    with pytest.raises(ValueError, match="grad_state"):
        torch.ops.tk.ssd_backward(torch.zeros_like(x), torch.zeros(1, 2, 4, 4), x, dt, A, B, C, None, None, 4)


@pytest.mark.parametrize("name", ["x", "dt", "B", "C"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_ssd_non_finite_input_reaches_only_later_positions(name, bad):
    """A non-finite value at position t (x, dt or B: the state from t on; C: output t only) never reaches earlier
    outputs, as in the token-by-token recurrence; the finite outputs and their gradients stay exact."""
    l, t = 150, 100  # t inside the reference's second chunk of 64
    x, dt, A, B, C = (a.double().requires_grad_() for a in _ssd_inputs(l))
    clean = dict(x=x, dt=dt, B=B, C=C)
    dirty = {k: v.detach().clone() for k, v in clean.items()}
    dirty[name][0, t, 0] = bad
    dirty = {k: v.requires_grad_() for k, v in dirty.items()}
    y, state = torch.ops.tk.ssd(dirty["x"], dirty["dt"], A, dirty["B"], dirty["C"], None, None, 64)
    want, _ = tk_inductor.ops.ssd.ssd_recurrence(dirty["x"], dirty["dt"], A, dirty["B"], dirty["C"])
    assert torch.isfinite(y[:, :t]).all()
    torch.testing.assert_close(y[:, :t], want[:, :t])
    assert not torch.isfinite(y[:, t]).all()
    assert torch.isfinite(state).all() == (name == "C")
    # The finite outputs' gradients equal the clean inputs' (nothing at or after t contributes to them).
    y_clean, _ = torch.ops.tk.ssd(x, dt, A, B, C, None, None, 64)
    got = torch.autograd.grad(y[:, :t].sum(), list(dirty.values()))
    ref = torch.autograd.grad(y_clean[:, :t].sum(), list(clean.values()))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("feature_map", ["identity", "based"])
def test_linear_attention_non_finite_input_reaches_only_later_positions(name, feature_map):
    N, t = 150, 100
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, 4, generator=g, dtype=torch.float64) for _ in range(3))
    inputs = dict(q=q, k=k, v=v)
    inputs[name][0, 1, t, 2] = float("nan")
    o = torch.ops.tk.linear_attention(*inputs.values(), feature_map, None, None, 0.5, True, 1e-6)
    assert torch.isfinite(o[:, :, :t]).all() and torch.isfinite(o[:, 0]).all()
    assert not torch.isfinite(o[0, 1, t]).all()
    assert torch.isfinite(o[0, 1, t + 1:]).all() == (name == "q")
    for x in inputs.values():
        x[0, 1, t:] = 0.0  # the same inputs with the later positions finite: the same earlier outputs
    clean = torch.ops.tk.linear_attention(*inputs.values(), feature_map, None, None, 0.5, True, 1e-6)
    torch.testing.assert_close(o[:, :, :t], clean[:, :, :t])


def test_layernorm_backward_checks_its_arguments():
    x = torch.randn(6, 16)
    w = torch.randn(16)
    y, h, mean, rstd, rng = torch.ops.tk.layernorm(x, None, w, None, None, 1e-5, 0.0, False)
    dy = torch.randn_like(y)
    ok = (dy, None, x, w, mean, rstd, rng, 0.0, False, False)
    torch.ops.tk.layernorm_backward(*ok)
    cases = {
        "rstd": (dy, None, x, w, mean, rstd[:3], rng, 0.0, False, False),
        "mean": (dy, None, x, w, mean[:2], rstd, rng, 0.0, False, False),
        "weight": (dy, None, x, w[:8], mean, rstd, rng, 0.0, False, False),
        "dy": (dy[:3], None, x, w, mean, rstd, rng, 0.0, False, False),
    }
    for name, args in cases.items():
        with pytest.raises(ValueError, match=name):
            torch.ops.tk.layernorm_backward(*args)


@pytest.mark.parametrize("call", [
    lambda t: torch.ops.tk.attention(t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8), None, 0.5),
    lambda t: torch.ops.tk.attention_backward(t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8),
                                              t(1, 2, 4, 8), t(1, 2, 4), None, 0.5),
    lambda t: torch.ops.tk.rotary(t(1, 2, 4, 8), None, t(4, 8), t(4, 8), None, False, False),
    lambda t: torch.ops.tk.rotary(t(1, 2, 4, 8), None, t(4, 8), t(4, 8), False, None, False),
    lambda t: torch.ops.tk.layernorm(t(4, 16), None, None, None, None, 1e-5, 0.0, None),
    lambda t: torch.ops.tk.layernorm(t(4, 16), None, None, None, None, 1e-5, 0.0, True, None),
    lambda t: torch.ops.tk.layernorm_backward(t(4, 16), None, t(4, 16), None, t(4), t(4), torch.zeros(2, dtype=torch.long),
                                              0.0, False, None),
    lambda t: torch.ops.tk.linear_attention(t(1, 2, 4, 16), t(1, 2, 4, 16), t(1, 2, 4, 8), "based", None, None, 0.25, None),
], ids=["attention", "attention_backward", "rotary-interleaved", "rotary-backward", "layernorm-rms", "layernorm-stats",
        "layernorm_backward", "linear_attention"])
def test_flags_reject_none(call):
    """A flag passed as None is a TypeError naming it: the ops' schemas take `bool?`, since a `bool` argument would
    turn None into False on its way in."""
    import tk_inductor.ops.rotary  # noqa: F401

    with pytest.raises(TypeError, match="must be a bool, got None"):
        call(lambda *s: torch.randn(*s))
