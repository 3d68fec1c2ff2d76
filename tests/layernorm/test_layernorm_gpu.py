"""GPU tests of the layernorm kernels against their PyTorch references (outputs NaN-poisoned first: kernel_checks.py)."""
from __future__ import annotations

import math

import pytest
import torch

import tk_inductor.ops.layernorm as ln_ops
from kernel_checks import DTYPES, TOL, poison, rel_err
from tk_inductor import build
from tk_inductor.ops import philox

pytestmark = pytest.mark.gpu

# every per-row work split, plus hidden sizes that leave part of the last vectors masked
HIDDEN = [8, 136, 256, 520, 1024, 1032, 2048, 3000, 4096, 5000, 6144, 8192, 16384]


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    for family in ("layernorm",):
        build.load(family)


def _ln_inputs(rows, hidden, dtype, residual, weight, bias, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    x = mk(rows, hidden)
    r = mk(rows, hidden) if residual else None
    w = mk(hidden) if weight else None
    b = mk(hidden) if bias else None
    return x, r, w, b


def _ln_kernel(x, r, w, b, rng, eps, p, rms):
    rows, hidden = x.shape
    poison(((rows, hidden), x.dtype), ((rows, hidden), x.dtype), ((rows,), torch.float32), ((rows,), torch.float32))
    return torch.ops.tk.layernorm(x, r, w, b, rng, eps, p, rms)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
def test_layernorm_forward_backward(hidden, dtype, rms):
    rows = 77  # odd: partial blocks of rows
    for residual, weight, bias in ((True, True, not rms), (False, False, False), (True, False, False), (False, True, not rms)):
        x, r, w, b = _ln_inputs(rows, hidden, dtype, residual, weight, bias)
        y, h, mean, rstd, rng = _ln_kernel(x, r, w, b, None, 1e-5, 0.0, rms)
        ye, he, me, re, _ = ln_ops.reference_forward(x, r, w, b, None, 1e-5, 0.0, rms)
        assert rel_err(y, ye) < TOL[dtype], (residual, weight, bias)
        assert rel_err(rstd, re) < 1e-5
        if not rms:
            assert (mean - me).abs().max().item() < 1e-4
        if residual:
            assert torch.equal(h, he)  # same fp32 add, same rounding
        else:
            assert h.numel() == 0
        # backward
        g = torch.Generator(device="cuda").manual_seed(1)
        dy = torch.randn(rows, hidden, generator=g, device="cuda").to(dtype)
        dh = torch.randn(rows, hidden, generator=g, device="cuda").to(dtype) if residual else None
        hh = h if residual else x
        poison(((rows, hidden), dtype), ((hidden,), dtype), ((hidden,), dtype))
        out = torch.ops.tk.layernorm_backward(dy, dh, hh, w, mean, rstd, rng, 0.0, rms, b is not None)
        ref = ln_ops.reference_backward(dy, dh, hh, w, mean, rstd, rng, 0.0, rms, b is not None)
        for name, a, e in zip(("dres", "dx", "dw", "db"), out, ref):
            assert a.shape == e.shape, name
            if e.numel():
                assert rel_err(a, e) < TOL[dtype] * (4 if name in ("dw", "db") else 1), (name, residual, weight, bias)


# (x, residual/h, weight, y) dtypes beside one dtype throughout (layernorm.h DTypes): the fp32 residual stream of
# autocast with fp32 parameters, fp32 weights on 16-bit activations, 16-bit weights and output on fp32 rows.
LN_MIXED = [(x, h, w, y) for x in DTYPES for h in DTYPES for w in DTYPES for y in DTYPES
         if ln_ops.kernel_supports(x, h, w, y) and len({x, h, w, y}) > 1]


def test_mixed_dtype_list():
    assert len(LN_MIXED) == 14  # 17 combinations, 3 of them one dtype throughout


@pytest.mark.parametrize("x_dtype, h_dtype, w_dtype, y_dtype", LN_MIXED, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("hidden", [136, 1024, 3000, 5120, 6000, 8192, 16384])
def test_layernorm_mixed_dtypes(x_dtype, h_dtype, w_dtype, y_dtype, hidden):
    rows = 77
    for rms in (False, True):
        for residual, p in ((True, 0.0), (False, 0.0), (True, 0.1)):
            if not residual and h_dtype != x_dtype:
                continue  # without a residual h is x
            x, _, _, _ = _ln_inputs(rows, hidden, x_dtype, False, False, False)
            _, r, w, b = _ln_inputs(rows, hidden, h_dtype, residual, True, False, seed=1)
            w = w.to(w_dtype)
            b = None if rms else torch.randn(hidden, device="cuda").to(w_dtype)
            rng = philox.draw_seed() if p else None
            case = (rms, residual, p)
            poison(((rows, hidden), y_dtype), ((rows, hidden), h_dtype))
            y, h, mean, rstd, rng = torch.ops.tk.layernorm(x, r, w, b, rng, 1e-5, p, rms, True, y_dtype)
            ye, he, me, re, _ = ln_ops.reference_forward(x, r, w, b, rng, 1e-5, p, rms, True, y_dtype)
            assert y.dtype == y_dtype and h.dtype == he.dtype, case
            assert rel_err(y, ye) < TOL[y_dtype], case
            assert rel_err(rstd, re) < 1e-5, case
            if residual or p:
                assert torch.equal(h, he), case  # same fp32 add, same rounding
            g = torch.Generator(device="cuda").manual_seed(2)
            dy = torch.randn(rows, hidden, generator=g, device="cuda").to(y_dtype)
            dh = torch.randn(rows, hidden, generator=g, device="cuda").to(h_dtype) if residual else None
            hh = h if (residual or p) else x
            out = torch.ops.tk.layernorm_backward(dy, dh, hh, w, mean, rstd, rng, p, rms, b is not None, x_dtype)
            ref = ln_ops.reference_backward(dy, dh, hh, w, mean, rstd, rng, p, rms, b is not None, x_dtype)
            for name, a, e in zip(("dres", "dx", "dw", "db"), out, ref):
                assert a.shape == e.shape and a.dtype == e.dtype, (name, case)
                if e.numel():
                    tol = TOL[e.dtype] * (4 if name in ("dw", "db") else 1)
                    assert rel_err(a, e) < tol, (name, case)


# (x, h, w, y): one dtype throughout, and the autocast norm (bf16 branch, fp32 residual stream and weight)
SUMMED = [(torch.bfloat16,) * 4, (torch.float32,) * 4, (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtypes", SUMMED, ids=lambda d: "-".join(str(t).split(".")[-1] for t in d))
@pytest.mark.parametrize("hidden", [136, 1024, 3000, 8192, 16384])
@pytest.mark.parametrize("terms", [2, 3])
def test_layernorm_backward_sums_dy(dtypes, hidden, terms):
    """dy + dy2 (+ dy3), summed as the kernel loads them (the post-grad pass folds autograd's sum of the gradients
    of a norm that feeds several matmuls), against the reference's fp32 sum. The register-only kernel (fp32 rows
    whose staging does not fit in shared memory) rounds the sum to y's dtype once, as eager's add does: the
    tolerance is y's."""
    x_dtype, h_dtype, w_dtype, y_dtype = dtypes
    rows = 77
    x, _, _, _ = _ln_inputs(rows, hidden, x_dtype, False, False, False)
    _, r, w, _ = _ln_inputs(rows, hidden, h_dtype, True, True, False, seed=1)
    w = w.to(w_dtype)
    y, h, mean, rstd, rng = torch.ops.tk.layernorm(x, r, w, None, None, 1e-5, 0.0, True, True, y_dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    dys = [torch.randn(rows, hidden, generator=g, device="cuda").to(y_dtype) for _ in range(terms)]
    dh = torch.randn(rows, hidden, generator=g, device="cuda").to(h_dtype)
    more = dys[1:] + [None] * (3 - terms)
    poison(((rows, hidden), h_dtype), ((rows, hidden), x_dtype))
    out = torch.ops.tk.layernorm_backward(dys[0], dh, h, w, mean, rstd, rng, 0.0, True, False, x_dtype, *more)
    ref = ln_ops.reference_backward(dys[0], dh, h, w, mean, rstd, rng, 0.0, True, False, x_dtype, *more)
    for name, a, e in zip(("dres", "dx", "dw"), out, ref):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        if e.numel():
            assert rel_err(a, e) < TOL[y_dtype] * (4 if name == "dw" else 1), name


def test_layernorm_mixed_autograd():
    """fp32 residual stream, bf16 branch output, fp32 weight, output cast to bf16: gradients in each input's dtype."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(300, 1024, generator=g, device="cuda").bfloat16().requires_grad_()
    r = torch.randn(300, 1024, generator=g, device="cuda").requires_grad_()
    w = torch.randn(1024, generator=g, device="cuda").requires_grad_()
    y, h, *_ = torch.ops.tk.layernorm(x, r, w, None, None, 1e-6, 0.0, True, True, torch.bfloat16)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    grads = torch.autograd.grad((y.float() * gy).sum() + (h * gh).sum(), (x, r, w))
    he = r + x.float()
    ye = (he * torch.rsqrt(he.pow(2).mean(-1, keepdim=True) + 1e-6) * w).bfloat16()
    ref = torch.autograd.grad((ye.float() * gy).sum() + (he * gh).sum(), (x, r, w))
    for a, e in zip(grads, ref):
        assert a.dtype == e.dtype
        assert rel_err(a, e) < 1e-2


def test_layernorm_backward_is_deterministic():
    x, r, w, b = _ln_inputs(4099, 1024, torch.bfloat16, True, True, True)
    y, h, mean, rstd, rng = torch.ops.tk.layernorm(x, r, w, b, None, 1e-5, 0.0, False)
    dy = torch.randn_like(y)
    a = torch.ops.tk.layernorm_backward(dy, None, h, w, mean, rstd, rng, 0.0, False, True)
    c = torch.ops.tk.layernorm_backward(dy, None, h, w, mean, rstd, rng, 0.0, False, True)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("hidden", [1024, 4104])
def test_layernorm_without_stats(hidden, rms):
    """stats=False (inference): the same y and h bit for bit, no mean/rstd; p > 0 keeps the same mask."""
    x, r, w, b = _ln_inputs(1001, hidden, torch.bfloat16, True, True, not rms)
    for p in (0.0, 0.1):
        rng = philox.draw_seed() if p else None
        full = _ln_kernel(x, r, w, b, rng, 1e-5, p, rms)
        lean = torch.ops.tk.layernorm(x, r, w, b, rng, 1e-5, p, rms, stats=False)
        assert torch.equal(lean[0], full[0]) and torch.equal(lean[1], full[1])
        assert lean[2].numel() == 0 and lean[3].numel() == 0


def test_layernorm_many_rows_per_block():
    # enough rows that every block of a persistent grid loops several times, with a ragged last group
    x, r, w, b = _ln_inputs(100003, 256, torch.bfloat16, True, True, True)
    y, h, mean, rstd, rng = _ln_kernel(x, r, w, b, None, 1e-5, 0.0, False)
    ye, he, *_ = ln_ops.reference_forward(x, r, w, b, None, 1e-5, 0.0, False)
    assert rel_err(y, ye) < 1e-2 and torch.equal(h, he)
    dy, dh = torch.randn_like(y), torch.randn_like(y)
    out = torch.ops.tk.layernorm_backward(dy, dh, h, w, mean, rstd, rng, 0.0, False, True)
    ref = ln_ops.reference_backward(dy, dh, h, w, mean, rstd, rng, 0.0, False, True)
    for a, e in zip(out, ref):
        if e.numel():
            assert rel_err(a, e) < 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [264, 1024, 4096])
@pytest.mark.parametrize("residual", [False, True])
def test_dropout(dtype, hidden, residual):
    p, rows = 0.2, 513
    x, r, w, b = _ln_inputs(rows, hidden, dtype, residual, True, True)
    rng = torch.tensor([0x0123456789ABCDEF, 977], dtype=torch.int64)
    y, h, mean, rstd, rng_out = _ln_kernel(x, r, w, b, rng, 1e-5, p, False)
    assert torch.equal(rng_out, rng)
    # kernel mask == philox reference mask, bit for bit (h is the same fp32 arithmetic)
    ye, he, *_ = ln_ops.reference_forward(x, r, w, b, rng, 1e-5, p, False)
    assert torch.equal(h, he)
    assert rel_err(y, ye) < TOL[dtype]
    keep = philox.keep_mask(x.shape, *philox.unpack(rng), p, "cuda")
    dropped = h - (r if residual else 0)
    assert (dropped[~keep] == 0).all()
    scale = philox.dropout_scale(p)
    kept = (x.float() * scale).to(dtype) if not residual else None
    if kept is not None:
        assert torch.equal(dropped[keep], kept[keep])
    # keep-rate within 4 sigma of 1 - p
    n = keep.numel()
    assert abs(keep.double().mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)
    # same seed -> same result; another seed -> another mask
    assert torch.equal(_ln_kernel(x, r, w, b, rng, 1e-5, p, False)[1], h)
    other = torch.tensor([0x0123456789ABCDEF, 978], dtype=torch.int64)
    assert not torch.equal(_ln_kernel(x, r, w, b, other, 1e-5, p, False)[1], h)
    # backward: dx follows the regenerated mask
    dy = torch.randn_like(y)
    out = torch.ops.tk.layernorm_backward(dy, None, h, w, mean, rstd, rng, p, False, True)
    ref = ln_ops.reference_backward(dy, None, h, w, mean, rstd, rng, p, False, True)
    assert (out[1][~keep] == 0).all()
    for a, e in zip(out, ref):
        assert rel_err(a, e) < TOL[dtype] * 4


def test_dropout_autograd_end_to_end():
    torch.manual_seed(0)
    x = torch.randn(300, 512, device="cuda", requires_grad=True)
    r = torch.randn(300, 512, device="cuda", requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    torch.manual_seed(7)
    y, h, *_ , rng = torch.ops.tk.layernorm(x, r, w, None, None, 1e-5, 0.1, False)
    torch.manual_seed(7)
    assert torch.equal(rng, philox.draw_seed())  # seeds come from the default generator
    loss = (y * torch.linspace(-1, 1, y.numel(), device="cuda").reshape(y.shape)).sum() + h.sum()
    gx, gr, gw = torch.autograd.grad(loss, (x, r, w))
    keep = philox.keep_mask(x.shape, *philox.unpack(rng), 0.1, "cuda")
    hf = torch.where(keep, x * philox.dropout_scale(0.1), 0) + r
    ye = torch.nn.functional.layer_norm(hf, (512,), w, None, 1e-5)
    loss_e = (ye * torch.linspace(-1, 1, y.numel(), device="cuda").reshape(y.shape)).sum() + hf.sum()
    ex, er, ew = torch.autograd.grad(loss_e, (x, r, w))
    for a, e in ((gx, ex), (gr, er), (gw, ew)):
        assert rel_err(a, e) < 1e-4
