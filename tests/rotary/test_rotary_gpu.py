"""GPU tests of the rotary kernels against their PyTorch references (outputs NaN-poisoned first: kernel_checks.py)."""
from __future__ import annotations

import pytest
import torch

import tk_inductor.ops.rotary as rot_ops
from kernel_checks import DTYPES, TOL, poison, rel_err
from tk_inductor import build

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    for family in ("rotary",):
        build.load(family)


def _rot_inputs(B, H, N, D, rd, dtype, layout, general, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)
    if layout == "BNHD":
        q = mk(B, N, H, D).transpose(1, 2)
        k = mk(B, N, max(1, H // 2), D).transpose(1, 2)
    else:
        q = mk(B, H, N, D)
        k = mk(B, max(1, H // 2), N, D)
    if general:
        cos, sin = mk(B, N, rd), mk(B, N, rd)
    else:
        ang = torch.rand(B, N, rd // 2, generator=g, device="cuda") * 6.3
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    return q, k, cos.unsqueeze(1), sin.unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["BHND", "BNHD"])
@pytest.mark.parametrize("D, rd", [(128, 128), (64, 64), (128, 32), (80, 40), (20, 12), (18, 10)])
def test_rotary(dtype, interleaved, layout, D, rd):
    B, H, N = 2, 4, 37
    for general in (False, True):
        q, k, cos, sin = _rot_inputs(B, H, N, D, rd, dtype, layout, general)
        for backward in (False, True):
            for contiguous in (False, True):
                poison((tuple(q.shape), dtype), (tuple(k.shape), dtype))
                qo, ko = torch.ops.tk.rotary(q, k, cos, sin, interleaved, backward, contiguous)
                qe, ke = rot_ops.reference(q, k, cos, sin, interleaved, backward, contiguous)
                assert qo.stride() == qe.stride() and ko.stride() == ke.stride()
                assert rel_err(qo, qe) < TOL[dtype] and rel_err(ko, ke) < TOL[dtype]
                # pass-through channels are copied exactly
                assert torch.equal(qo[..., rd:], q[..., rd:])


# (x, cos/sin, y) dtypes beside one dtype throughout: fp32 tables on 16-bit x writing the promoted fp32 result or
# its cast back, and the backward of the promoted forward (fp32 gradients, 16-bit input gradients).
MIXED = [(torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.bfloat16),
         (torch.float16, torch.float32, torch.float32), (torch.float16, torch.float32, torch.float16),
         (torch.float32, torch.float32, torch.bfloat16), (torch.float32, torch.float32, torch.float16)]


@pytest.mark.parametrize("x_dtype, table_dtype, out_dtype", MIXED)
@pytest.mark.parametrize("layout", ["BHND", "BNHD"])
def test_rotary_mixed_dtypes(x_dtype, table_dtype, out_dtype, layout):
    assert rot_ops.kernel_supports(x_dtype, table_dtype, out_dtype)
    for D, rd in ((128, 128), (128, 32), (80, 40), (18, 10)):
        q, k, _, _ = _rot_inputs(2, 5, 37, D, rd, x_dtype, layout, True)
        _, _, cos, sin = _rot_inputs(2, 5, 37, D, rd, table_dtype, layout, True, seed=1)
        for interleaved in (False, True):
            for backward in (False, True):
                poison((tuple(q.shape), out_dtype), (tuple(k.shape), out_dtype))
                qo, ko = torch.ops.tk.rotary(q, k, cos, sin, interleaved, backward, False, out_dtype)
                qe, ke = rot_ops.reference(q, k, cos, sin, interleaved, backward, False, out_dtype)
                case = (D, rd, interleaved, backward)
                assert qo.dtype == ko.dtype == out_dtype, case
                assert rel_err(qo, qe) < TOL[out_dtype] and rel_err(ko, ke) < TOL[out_dtype], case
                assert torch.equal(qo[..., rd:], q[..., rd:].to(out_dtype)), case


def test_rotary_per_head_tables_and_wide_heads():
    """Shapes the tile kernel leaves to the row kernel: tables that vary over heads, very wide heads."""
    for dtype, table_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
        g = torch.Generator(device="cuda").manual_seed(3)
        q = torch.randn(2, 4, 33, 64, generator=g, device="cuda").to(dtype)
        cos = torch.randn(2, 4, 33, 64, generator=g, device="cuda").to(table_dtype)
        sin = torch.randn(2, 4, 33, 64, generator=g, device="cuda").to(table_dtype)
        for backward in (False, True):
            qo, _ = torch.ops.tk.rotary(q, None, cos, sin, False, backward, False)
            qe, _ = rot_ops.reference(q, None, cos, sin, False, backward, False)
            assert rel_err(qo, qe) < TOL[qo.dtype]
        wide = torch.randn(1, 2, 3, 8192, generator=g, device="cuda").to(dtype)
        wc = torch.randn(1, 1, 3, 8192, generator=g, device="cuda").to(table_dtype)
        qo, _ = torch.ops.tk.rotary(wide, None, wc, wc, True, False, False)
        qe, _ = rot_ops.reference(wide, None, wc, wc, True, False, False)
        assert rel_err(qo, qe) < TOL[qo.dtype]


def test_rotary_single_and_autograd():
    q, k, cos, sin = _rot_inputs(2, 8, 129, 128, 128, torch.bfloat16, "BNHD", False)
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    qo, ko = torch.ops.tk.rotary(q, k, cos, sin, False, False, False)
    g1, g2 = torch.randn_like(qo), torch.randn_like(ko)
    dq, dk = torch.autograd.grad((qo * g1).sum() + (ko * g2).sum(), (q, k))
    eq, ek = rot_ops.reference(g1, g2, cos, sin, False, True, False)
    assert rel_err(dq, eq) < 1e-2 and rel_err(dk, ek) < 1e-2
    only_q = torch.ops.tk.rotary(q, None, cos, sin, False, False, False)
    assert only_q[1].numel() == 0 and torch.equal(only_q[0], qo)


@pytest.mark.parametrize("tables", ["half", "complex"])
def test_rotary_other_table_forms(monkeypatch, tables):
    """gpt-oss's half-width tables and the complex spelling's factors, through the adapters the matcher calls: the
    kernel runs (raw calls recorded) and equals the eager spelling, forward and q/k gradients."""
    from kernel_checks import record_raw_calls

    calls = record_raw_calls(monkeypatch)
    B, N, H, D = 2, 777, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.randn(B, N, H, D, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    angle = torch.rand(N, D // 2, device="cuda", generator=g) * 6.3
    c, s = angle.cos(), angle.sin()
    if tables == "half":
        out = rot_ops.rotary_half_tables(q, k, c[None, :, None], s[None, :, None], False, False, False)

        def eager(x):
            x1, x2 = x.float().chunk(2, -1)
            return torch.cat((x1 * c[:, None] - x2 * s[:, None], x2 * c[:, None] + x1 * s[:, None]), -1)
    else:
        freqs = torch.polar(torch.ones_like(angle), angle)[None, :, None]
        out = rot_ops.rotary_complex_tables(q, k, freqs, True, False, False)

        def eager(x):
            return torch.view_as_real(torch.view_as_complex(x.float().reshape(B, N, H, -1, 2)) * freqs).flatten(3)
    assert calls == ["rotary"]
    qr, kr = (t.detach().float().requires_grad_() for t in (q, k))
    want = (eager(qr), eager(kr))
    for got, ref in zip(out, want):
        assert rel_err(got, ref) < TOL[torch.bfloat16]
    w = [torch.randn_like(t) for t in want]
    grads = torch.autograd.grad(out, (q, k), w)
    refs = torch.autograd.grad(want, (qr, kr), w)
    for got, ref in zip(grads, refs):
        assert rel_err(got, ref) < TOL[torch.bfloat16]
