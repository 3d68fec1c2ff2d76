"""The gated norm, h = x·silu(gate) then RMSNorm/LayerNorm (Mamba-2's MambaRMSNormGated): tk::layernorm's `gate`
operand against eager (CPU, reference mode), the matcher on HF's spelling, and the CUDA kernels against the
reference (GPU tests at the end, odd row counts and every per-row split)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor import build
from tk_inductor.ops import layernorm as ln_ops

OPTS = {"reference": True, "inner": "aot_eager"}


def _eager(x, z, w, eps, rms=True):
    """MambaRMSNormGated's arithmetic (one group): fp32 product and statistics, then the weight."""
    h = x.float() * F.silu(z.float())
    if rms:
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    else:
        n = F.layer_norm(h, (h.shape[-1],), eps=eps)
    return n * w.float() if w is not None else n


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_op_matches_eager(rms, gate_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g).requires_grad_()
    z = torch.randn(5, 3, 64, generator=g).to(gate_dtype).requires_grad_()
    w = torch.randn(64, generator=g).requires_grad_()
    y, h, mean, rstd, _ = torch.ops.tk.layernorm(x, None, w, None, None, 1e-6, 0.0, rms, gate=z)
    ref = _eager(x, z, w, 1e-6, rms)
    assert y.dtype == torch.float32 and h.numel() == 0 and (mean.numel() == 0) == rms
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, (x, z, w), dy)
    want = torch.autograd.grad(ref, (x, z, w), dy)
    for a, b, name in zip(got, want, ("dx", "dgate", "dw")):
        assert a.dtype == b.dtype, name
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=name)


def test_opcheck():
    x, z, w = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True), torch.randn(16)
    torch.library.opcheck(torch.ops.tk.layernorm.default, (x, None, w, None, None, 1e-6, 0.0, True, True, None, z))
    with torch.no_grad():
        _, _, mean, rstd, rng = torch.ops.tk.layernorm(x, None, w, None, None, 1e-6, 0.0, True, gate=z)
    torch.library.opcheck(torch.ops.tk.layernorm_backward.default,
                          (torch.randn(4, 16), None, x.detach(), w, mean, rstd, rng, 0.0, True, False, None, None, None,
                           z.detach()))


@pytest.mark.parametrize("call", [
    lambda x, z: torch.ops.tk.layernorm(x, torch.randn(4, 16), None, None, None, 1e-6, 0.0, True, gate=z),
    lambda x, z: torch.ops.tk.layernorm(x, None, None, None, None, 1e-6, 0.1, True, gate=z),
    lambda x, z: torch.ops.tk.layernorm(x, None, None, None, None, 1e-6, 0.0, True, gate=z[:, :8]),
])
def test_bad_inputs(call):
    with pytest.raises(ValueError):
        call(torch.randn(4, 16), torch.randn(4, 16))


# ---------------------------------------------------------------------------- the matcher

class GatedRMS(nn.Module):
    """transformers' MambaRMSNormGated, written out (one group: the (..., 1, size) view)."""

    def __init__(self, hidden=64, groups=1, silu_dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.group_size, self.silu_dtype = hidden // groups, silu_dtype

    def forward(self, x, gate):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * F.silu(gate.to(self.silu_dtype)).to(torch.float32)
        *prefix, last = h.shape
        hg = h.view(*prefix, last // self.group_size, self.group_size)
        hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * hg.view(*prefix, last).to(dtype)


@pytest.mark.parametrize("x_dtype, gate_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16)])
def test_hf_gated_norm_is_replaced(x_dtype, gate_dtype):
    tk_inductor.reset()
    m = GatedRMS().to(x_dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 64, generator=g).to(x_dtype).requires_grad_()
    z = torch.randn(2, 7, 64, generator=g).to(gate_dtype).requires_grad_()
    out = torch.compile(m, backend="thunderkittens", options=OPTS)(x, z)
    ref = m(x, z)
    rep = tk_inductor.report()
    assert rep.replaced.get("layernorm") == 1, str(rep)
    assert out.dtype == ref.dtype
    tol = 1e-5 if x_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    dy = torch.randn(ref.shape, generator=g).to(ref.dtype)
    params = (x, z, m.weight)
    for a, b in zip(torch.autograd.grad(out, params, dy), torch.autograd.grad(ref, params, dy)):
        assert a.dtype == b.dtype
        t = 1e-4 if a.dtype == torch.float32 and x_dtype == torch.float32 else 3e-2
        torch.testing.assert_close(a, b, atol=t * b.abs().max().item(), rtol=t)


@pytest.mark.parametrize("module, reason", [
    (GatedRMS(groups=2), "grouped gated norm"),
    (GatedRMS(silu_dtype=torch.bfloat16), "silu(z) computed in torch.bfloat16"),
])
def test_kept_with_reason(module, reason):
    tk_inductor.reset()
    x, z = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    torch.testing.assert_close(torch.compile(module, backend="thunderkittens", options=OPTS)(x, z), module(x, z))
    rep = tk_inductor.report()
    assert not rep.replaced.get("layernorm"), str(rep)
    assert any(f == "layernorm" and reason in r for f, r in rep.kept), str(rep)


# ---------------------------------------------------------------------------- the CUDA kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (weight, y): the (w, y) pairs of fp32 rows (layernorm.h gate_supported), and no weight
WY = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
      (torch.float16, torch.float16), (None, torch.float32)]
HIDDEN = [8, 136, 520, 1032, 3000, 5120, 6000, 8192, 16384]  # every per-row split, masked tails


def _rel(a, b):
    assert not torch.isnan(a).any(), "NaN in kernel output (unwritten or invalid)"
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gate_dtype", DTYPES, ids=str)
def test_kernel_matches_reference(hidden, x_dtype, gate_dtype):
    build.load("layernorm")
    rows = 77  # odd: partial blocks of rows
    g = torch.Generator(device="cuda").manual_seed(hidden)
    mk = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g, device="cuda").to(dtype)
    x, z = mk(rows, hidden, dtype=x_dtype), mk(rows, hidden, dtype=gate_dtype)
    for (w_dtype, y_dtype) in WY:
        for rms in (True, False):
            case = (w_dtype, y_dtype, rms)
            w = mk(hidden, dtype=w_dtype) if w_dtype else None
            args = (x, None, w, None, None, 1e-6, 0.0, rms, True, y_dtype)
            assert ln_ops.forward_kernel_ok(x, None, w, None, y_dtype, z), case
            torch.full((rows, hidden), float("nan"), device="cuda", dtype=y_dtype)  # poison: freed right away
            y, h, mean, rstd, rng = torch.ops.tk.layernorm(*args, gate=z)
            ye, _, me, re, _ = ln_ops.reference_forward(*args, gate=z)
            assert y.dtype == y_dtype and h.numel() == 0, case
            tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[y_dtype]
            assert _rel(y, ye) < tol and _rel(rstd, re) < 1e-5, case
            dy = mk(rows, hidden, dtype=y_dtype)
            out = torch.ops.tk.layernorm_backward(dy, None, x, w, mean, rstd, rng, 0.0, rms, False, gate=z)
            ref = ln_ops.reference_backward(dy, None, x, w, mean, rstd, rng, 0.0, rms, False, gate=z)
            for name, a, e in zip(("dres", "dx", "dw", "db", "dgate"), out, ref):
                assert a.shape == e.shape and a.dtype == e.dtype, (name, case)
                if e.numel():
                    t = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}[e.dtype]
                    assert _rel(a, e) < t * (4 if name == "dw" else 1), (name, case)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16", "amp-fp16"])
def test_compiled_hf_gated_norm_on_the_kernels(precision):
    """HF's MambaRMSNormGated spelling compiled with the kernels (default options): replaced, and the output and
    gradients equal eager's under each recipe (fp32 x from the SSD, a 16-bit gate from the projection)."""
    build.load("layernorm")
    tk_inductor.reset()
    torch.manual_seed(0)
    m = GatedRMS(hidden=2048).cuda()
    if precision == "bf16":
        m = m.bfloat16()
    amp = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(precision)
    gdt = amp or torch.bfloat16
    x = torch.randn(3, 333, 2048, device="cuda").requires_grad_()
    z = torch.randn(3, 333, 2048, device="cuda").to(gdt).requires_grad_()
    run = lambda x, z: m(x, z).to(gdt)  # HF's out_proj(scan_output.to(dtype)): the bf16 model's cast, fused
    c = torch.compile(run, backend="thunderkittens")
    with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
        out, ref = c(x, z), run(x, z)
    assert tk_inductor.report().replaced.get("layernorm") == 1, str(tk_inductor.report())
    assert out.dtype == ref.dtype
    assert _rel(out, ref) < 1e-2
    dy = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, z, m.weight), dy), torch.autograd.grad(ref, (x, z, m.weight), dy)):
        assert a.dtype == b.dtype and _rel(a, b) < 2e-2
