"""tk::layernorm — residual + dropout + LayerNorm / RMSNorm, and its backward.

    h = residual + dropout(x)                      (residual optional, dropout p >= 0)
    y = (h - mean(h)) * rstd * w + b               LayerNorm, rstd = rsqrt(var(h) + eps)
    y = h * rstd * w                               RMSNorm,   rstd = rsqrt(mean(h²) + eps)

Statistics are fp32. Returns (y, h, mean, rstd, rng): h is empty when it equals x (no residual,
no dropout), mean is empty for RMSNorm, rng is the (seed, offset) pair the dropout mask was drawn
with (CPU int64, zeros without dropout) so the backward regenerates the mask instead of storing it.
When `rng` is None and p > 0 a fresh pair is drawn from the default CPU generator (philox.draw_seed).
With stats=False (inference: the backend passes it where the graph needs no gradient) mean and rstd are empty
and never written, and the op cannot be differentiated.
"""
from __future__ import annotations

import os

import torch

from . import _dispatch, philox

FAMILY = "layernorm"
MAX_HIDDEN = 16384
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_EMPTY_RNG = (2,)


# ---------------------------------------------------------------------------- validation

def _check(x, residual, weight, bias, rng, eps, p, rms) -> None:
    check = _dispatch.check
    check(isinstance(x, torch.Tensor), "tk::layernorm: x must be a tensor", TypeError)
    check(x.dtype in DTYPES, lambda: f"tk::layernorm: x dtype must be one of {DTYPES}, got {x.dtype}", TypeError)
    check(x.dim() >= 1, "tk::layernorm: x must have at least one dimension")
    hidden = x.shape[-1]
    check(hidden % 8 == 0 and 0 < hidden <= MAX_HIDDEN,
          lambda: f"tk::layernorm: hidden size must be a multiple of 8 in [8, {MAX_HIDDEN}], got {hidden}")
    for name, t, shape in (("residual", residual, tuple(x.shape)), ("weight", weight, (hidden,)), ("bias", bias, (hidden,))):
        if t is None:
            continue
        check(t.dtype == x.dtype,
              lambda: f"tk::layernorm: {name} dtype {t.dtype} must equal x dtype {x.dtype}", TypeError)
        check(t.device == x.device, lambda: f"tk::layernorm: {name} is on {t.device}, x on {x.device}")
        check(tuple(t.shape) == shape, lambda: f"tk::layernorm: {name} must have shape {shape}, got {tuple(t.shape)}")
    check(not (rms and bias is not None), "tk::layernorm: RMSNorm takes no bias")
    check(eps >= 0.0, lambda: f"tk::layernorm: eps must be >= 0, got {eps}")
    check(0.0 <= p < 1.0, lambda: f"tk::layernorm: dropout p must be in [0, 1), got {p}")
    if rng is not None:
        check(rng.device.type == "cpu" and rng.dtype == torch.int64 and rng.numel() == 2,
              "tk::layernorm: rng must be a CPU int64 tensor (seed, offset)")


# ---------------------------------------------------------------------------- references

def reference_forward(x, residual, weight, bias, rng, eps: float, p: float, rms: bool, stats: bool = True):
    """Plain PyTorch, fp32 statistics; dropout through the bit-identical philox reference."""
    dtype = x.dtype
    hidden = x.shape[-1]
    hf = x.float()
    if p > 0.0:
        seed, offset = philox.unpack(rng)
        keep = philox.keep_mask(x.shape, seed, offset, p, x.device)
        hf = torch.where(keep, hf * philox.dropout_scale(p), torch.zeros((), device=x.device))
    if residual is not None:
        hf = residual.float() + hf
    store_h = residual is not None or p > 0.0
    h = hf.to(dtype) if store_h else x.new_empty(0)
    hf = hf.to(dtype).float()  # statistics of the stored (rounded) h, as eager would see it
    rows = x.numel() // hidden
    if rms:
        mean = torch.empty(0, dtype=torch.float32, device=x.device)
        rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
        norm = hf * rstd.unsqueeze(-1)
    else:
        mu = hf.mean(-1)
        rstd = torch.rsqrt((hf - mu.unsqueeze(-1)).pow(2).mean(-1) + eps)
        norm = (hf - mu.unsqueeze(-1)) * rstd.unsqueeze(-1)
        mean = mu.reshape(rows).contiguous()
    if weight is not None:
        norm = norm * weight.float()
    if bias is not None:
        norm = norm + bias.float()
    rng_out = rng.clone() if p > 0.0 else torch.zeros(_EMPTY_RNG, dtype=torch.int64)
    if not stats:
        mean, rstd = (torch.empty(0, dtype=torch.float32, device=x.device) for _ in range(2))
    return norm.to(dtype), h, mean, rstd.reshape(-1).contiguous(), rng_out


def reference_backward(dy, dh, h, weight, mean, rstd, rng, p: float, rms: bool, has_bias: bool):
    """Explicit LayerNorm/RMSNorm backward (the kernel's formulas), fp32 accumulation."""
    dtype = h.dtype
    hidden = h.shape[-1]
    hf = h.float().reshape(-1, hidden)
    dyf = dy.float().reshape(-1, hidden)
    r = rstd.reshape(-1, 1)
    xhat = hf * r if rms else (hf - mean.reshape(-1, 1)) * r
    g = dyf * weight.float() if weight is not None else dyf
    mean_gx = (g * xhat).mean(-1, keepdim=True)
    mean_g = 0.0 if rms else g.mean(-1, keepdim=True)
    dn = r * (g - mean_g - xhat * mean_gx)
    if dh is not None:
        dn = dn + dh.float().reshape(-1, hidden)
    dres = dn.to(dtype).reshape(h.shape)
    if p > 0.0:
        seed, offset = philox.unpack(rng)
        keep = philox.keep_mask(h.shape, seed, offset, p, h.device)
        dx = torch.where(keep, dres.float() * philox.dropout_scale(p), torch.zeros((), device=h.device)).to(dtype)
    else:
        dx = h.new_empty(0)
    dw = (dyf * xhat).sum(0).to(dtype) if weight is not None else h.new_empty(0)
    db = dyf.sum(0).to(dtype) if has_bias else h.new_empty(0)
    return dres, dx, dw, db


# ---------------------------------------------------------------------------- the ops

FORWARD_VARIANTS, BACKWARD_VARIANTS = 9, 12  # kernel variants (csrc/kernels/layernorm/layernorm.h)


def _check_variant_env(name: str, count: int) -> None:
    """The benchmark switch the binding reads (TK_LN_FWD_VARIANT / TK_LN_BWD_VARIANT): a bad value is a Python
    error here, before the kernel is called."""
    value = os.environ.get(name, "")
    if value and not (value.isdigit() and int(value) < count):
        raise ValueError(f"tk::layernorm: {name} must be an integer in [0, {count}), got {value!r}")


@torch.library.custom_op("tk::layernorm", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def layernorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rng: torch.Tensor | None,
    eps: float,
    p: float,
    rms: bool,
    stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(x, residual, weight, bias, rng, eps, p, rms)
    if p > 0.0 and rng is None:
        rng = philox.draw_seed()
    if _dispatch.use_kernel(FAMILY, x, residual, weight, bias):
        _check_variant_env("TK_LN_FWD_VARIANT", FORWARD_VARIANTS)
        contig = [t.contiguous() if t is not None else None for t in (x, residual, weight, bias)]
        return _dispatch.kernel("layernorm")(*contig, rng, eps, p, rms, stats)
    return reference_forward(x, residual, weight, bias, rng, eps, p, rms, stats)


@layernorm.register_fake
def _(x, residual, weight, bias, rng, eps, p, rms, stats=True):
    _check(x, residual, weight, bias, rng, eps, p, rms)
    hidden = x.shape[-1]
    rows = x.numel() // hidden if stats else 0
    y = x.new_empty(x.shape)  # contiguous, like the kernel and the reference
    h = x.new_empty(x.shape) if (residual is not None or p > 0.0) else x.new_empty(0)
    mean = x.new_empty(0 if rms else rows, dtype=torch.float32)
    rstd = x.new_empty(rows, dtype=torch.float32)
    rng_out = torch.empty(_EMPTY_RNG, dtype=torch.int64, device="cpu")
    return y, h, mean, rstd, rng_out


@torch.library.custom_op("tk::layernorm_backward", mutates_args=())
def layernorm_backward(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rng: torch.Tensor,
    p: float,
    rms: bool,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _dispatch.check(dy.shape == h.shape and dy.dtype == h.dtype, "tk::layernorm_backward: dy must match h in shape and dtype")
    _dispatch.check(dh is None or (dh.shape == h.shape and dh.dtype == h.dtype), "tk::layernorm_backward: dh must match h")
    if _dispatch.use_kernel(FAMILY, dy, dh, h, weight, mean, rstd):
        _check_variant_env("TK_LN_BWD_VARIANT", BACKWARD_VARIANTS)
        contig = [t.contiguous() if t is not None else None for t in (dy, dh, h, weight)]
        return _dispatch.kernel("layernorm_backward")(*contig, mean.contiguous(), rstd.contiguous(), rng, p, rms, has_bias)
    return reference_backward(dy, dh, h, weight, mean, rstd, rng, p, rms, has_bias)


@layernorm_backward.register_fake
def _(dy, dh, h, weight, mean, rstd, rng, p, rms, has_bias):
    hidden = h.shape[-1]
    dres = h.new_empty(h.shape)
    dx = h.new_empty(h.shape) if p > 0.0 else h.new_empty(0)
    dw = h.new_empty(hidden if weight is not None else 0)
    db = h.new_empty(hidden if has_bias else 0)
    return dres, dx, dw, db


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, rng, eps, p, rms, stats = inputs
    _dispatch.check(stats, "tk::layernorm: called with stats=False (no mean/rstd kept), so it has no backward; "
                    "pass stats=True where gradients are needed", RuntimeError)
    y, h, mean, rstd, rng_out = output
    stored_h = residual is not None or p > 0.0
    ctx.save_for_backward(h if stored_h else x, weight, mean, rstd, rng_out)
    ctx.p, ctx.rms, ctx.has_bias, ctx.has_residual, ctx.stored_h = p, rms, bias is not None, residual is not None, stored_h


def _backward(ctx, dy, dh, dmean, drstd, drng):
    h, weight, mean, rstd, rng = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    if not ctx.stored_h or (dh is not None and dh.numel() == 0):
        dh = None
    dres, dx, dw, db = torch.ops.tk.layernorm_backward(dy, dh, h, weight, mean, rstd, rng, ctx.p, ctx.rms, ctx.has_bias)
    dx = dx if ctx.p > 0.0 else dres
    return (dx, dres if ctx.has_residual else None, dw if weight is not None else None,
            db if ctx.has_bias else None, None, None, None, None, None)


layernorm.register_autograd(_backward, setup_context=_setup_context)
