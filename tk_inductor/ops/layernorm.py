"""tk::layernorm — residual + dropout + LayerNorm / RMSNorm, and its backward.

    h = residual + dropout(x)                      (residual optional, dropout p >= 0)
    h = x · silu(gate)                             (gated: Mamba-2's MambaRMSNormGated; fp32, no residual/dropout)
    y = (h - mean(h)) * rstd * w + b               LayerNorm, rstd = rsqrt(var(h) + eps)
    y = h * rstd * w                               RMSNorm,   rstd = rsqrt(mean(h²) + eps)

Statistics are fp32. Returns (y, h, mean, rstd, rng): h is empty when it equals x (no residual,
no dropout) and with a gate (the backward recomputes it from x and the gate), mean is empty for RMSNorm, rng is the (seed, offset) pair the dropout mask was drawn
with (CPU int64, zeros without dropout) so the backward regenerates the mask instead of storing it.
When `rng` is None and p > 0 a fresh pair is drawn from the default CPU generator (philox.draw_seed).
With stats=False (inference: the backend passes it where the graph needs no gradient) mean and rstd are empty
and never written, and the op cannot be differentiated.

Dtypes, as eager gives them: h has x's and the residual's dtypes promoted (an fp32 residual stream beside bf16
branch outputs under autocast gives fp32), y has `out_dtype` (by default h's), and the weight and bias may have
another dtype than the activations (fp32 weights on bf16 activations). The arithmetic is fp32 throughout; y is
rounded once, so an `out_dtype` below the computed dtype is that result cast down (the matcher fuses such a cast).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _dispatch, philox

FAMILY = "layernorm"
MAX_HIDDEN = 16384
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)

_EMPTY_RNG = (2,)


def h_dtype(x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None = None) -> torch.dtype:
    if gate is not None:
        return torch.float32
    return torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype


def kernel_supports(x: torch.dtype, h: torch.dtype, w: torch.dtype | None, y: torch.dtype) -> bool:
    """The dtypes the CUDA kernels take (csrc/kernels/layernorm/layernorm.h `supported`): x any of DTYPES, h x's or
    fp32, y fp32 or the 16-bit dtype (x's, when x is 16-bit), the weight fp32 or y's (any, when absent)."""
    if x not in DTYPES or h not in (x, torch.float32):
        return False
    if y != torch.float32 and y != x and not (x == torch.float32 and y in _HALF):
        return False
    return w is None or w in (torch.float32, y)


def gate_supported(w: torch.dtype | None, y: torch.dtype) -> bool:
    """The dtypes the gated kernels take: x and the gate any of DTYPES; w and y as for fp32 x and h (layernorm.h)."""
    return kernel_supports(torch.float32, torch.float32, w, y)


def weight_dtype(x: torch.dtype, h: torch.dtype, w: torch.dtype | None, y: torch.dtype) -> torch.dtype:
    """The dtype of dw/db: the weight's, or (no weight) y's where the kernels take it, else fp32."""
    if w is not None:
        return w
    return y if kernel_supports(x, h, y, y) else torch.float32


# ---------------------------------------------------------------------------- validation

def _check(x, residual, weight, bias, rng, eps, p, rms, out_dtype=None, gate=None, stats=True) -> None:
    _dispatch.check_flags("tk::layernorm", rms=rms, stats=stats)
    check = _dispatch.check
    check(isinstance(x, torch.Tensor), "tk::layernorm: x must be a tensor", TypeError)
    check(x.dtype in DTYPES, lambda: f"tk::layernorm: x dtype must be one of {DTYPES}, got {x.dtype}", TypeError)
    check(x.dim() >= 1, "tk::layernorm: x must have at least one dimension")
    hidden = x.shape[-1]
    check(hidden % 8 == 0 and 0 < hidden <= MAX_HIDDEN,
          lambda: f"tk::layernorm: hidden size must be a multiple of 8 in [8, {MAX_HIDDEN}], got {hidden}")
    for name, t, shape in (("residual", residual, tuple(x.shape)), ("weight", weight, (hidden,)), ("bias", bias, (hidden,)),
                           ("gate", gate, tuple(x.shape))):
        if t is None:
            continue
        check(t.dtype in DTYPES, lambda: f"tk::layernorm: {name} dtype must be one of {DTYPES}, got {t.dtype}", TypeError)
        check(t.device == x.device, lambda: f"tk::layernorm: {name} is on {t.device}, x on {x.device}")
        check(tuple(t.shape) == shape, lambda: f"tk::layernorm: {name} must have shape {shape}, got {tuple(t.shape)}")
    check(weight is None or bias is None or weight.dtype == bias.dtype,
          lambda: f"tk::layernorm: weight {weight.dtype} and bias {bias.dtype} must have one dtype", TypeError)
    check(out_dtype is None or out_dtype in DTYPES,
          lambda: f"tk::layernorm: out_dtype must be one of {DTYPES} or None, got {out_dtype}", TypeError)
    check(not (rms and bias is not None), "tk::layernorm: RMSNorm takes no bias")
    check(gate is None or (residual is None and p == 0.0), "tk::layernorm: a gated norm takes no residual or dropout")
    check(eps >= 0.0, lambda: f"tk::layernorm: eps must be >= 0, got {eps}")
    check(0.0 <= p < 1.0, lambda: f"tk::layernorm: dropout p must be in [0, 1), got {p}")
    if rng is not None:
        check(philox.is_rng(rng), "tk::layernorm: rng must be a CPU int64 tensor (seed, offset)")


# ---------------------------------------------------------------------------- references

def reference_forward(x, residual, weight, bias, rng, eps: float, p: float, rms: bool, stats: bool = True, out_dtype=None,
                      gate=None):
    """Plain PyTorch, fp32 statistics; dropout through the bit-identical philox reference."""
    dtype = h_dtype(x, residual, gate)
    hidden = x.shape[-1]
    hf = x.float()
    if gate is not None:
        hf = hf * F.silu(gate.float())
    if p > 0.0:
        seed, offset = philox.unpack(rng)
        keep = philox.keep_mask(x.shape, seed, offset, p, x.device)
        hf = torch.where(keep, hf * philox.dropout_scale(p), torch.zeros((), device=x.device))
    if residual is not None:
        hf = residual.float() + hf
    store_h = residual is not None or p > 0.0
    h = hf.to(dtype).contiguous() if store_h else x.new_empty(0, dtype=dtype)
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
    return norm.to(out_dtype or dtype).contiguous(), h, mean, rstd.reshape(-1).contiguous(), rng_out


def reference_backward(dy, dh, h, weight, mean, rstd, rng, p: float, rms: bool, has_bias: bool, x_dtype=None,
                       dy2=None, dy3=None, gate=None):
    """Explicit LayerNorm/RMSNorm backward (the kernel's formulas), fp32 accumulation. The gradient of y is
    dy + dy2 + dy3 (those given), summed in fp32. With a gate, h is x and h = x·silu(gate) is recomputed."""
    x = h
    dtype = torch.float32 if gate is not None else h.dtype
    x_dtype = h.dtype if gate is not None else (x_dtype or dtype)
    w_dtype = weight_dtype(torch.float32 if gate is not None else x_dtype, dtype,
                           weight.dtype if weight is not None else None, dy.dtype)
    hidden = h.shape[-1]
    hf = h.float().reshape(-1, hidden)
    if gate is not None:
        zf = gate.float().reshape(-1, hidden)
        hf = hf * F.silu(zf)
    dyf = dy.float().reshape(-1, hidden)
    for more in (dy2, dy3):
        if more is not None:
            dyf = dyf + more.float().reshape(-1, hidden)
    r = rstd.reshape(-1, 1)
    xhat = hf * r if rms else (hf - mean.reshape(-1, 1)) * r
    g = dyf * weight.float() if weight is not None else dyf
    mean_gx = (g * xhat).mean(-1, keepdim=True)
    mean_g = 0.0 if rms else g.mean(-1, keepdim=True)
    dn = r * (g - mean_g - xhat * mean_gx)
    if dh is not None:
        dn = dn + dh.float().reshape(-1, hidden)
    dw = (dyf * xhat).sum(0).to(w_dtype) if weight is not None else h.new_empty(0, dtype=w_dtype)
    db = dyf.sum(0).to(w_dtype) if has_bias else h.new_empty(0, dtype=w_dtype)
    if gate is not None:
        s = torch.sigmoid(zf)
        dx = (dn * zf * s).to(x.dtype).reshape(h.shape)
        dgate = (dn * x.float().reshape(-1, hidden) * s * (1 + zf * (1 - s))).to(gate.dtype).reshape(h.shape)
        return h.new_empty(0, dtype=dtype), dx, dw, db, dgate
    dres = dn.to(dtype).reshape(h.shape)
    if p > 0.0:
        seed, offset = philox.unpack(rng)
        keep = philox.keep_mask(h.shape, seed, offset, p, h.device)
        dx = torch.where(keep, dres.float() * philox.dropout_scale(p), torch.zeros((), device=h.device)).to(x_dtype)
    elif x_dtype != dtype:  # h is wider than x (an fp32 residual): x's gradient is dres cast, as eager's add gives
        dx = dres.to(x_dtype)
    else:
        dx = h.new_empty(0, dtype=x_dtype)
    return dres, dx, dw, db, h.new_empty(0)


# ---------------------------------------------------------------------------- the ops

def _kernel_ok(x, residual, weight, bias, out_dtype, gate=None) -> bool:
    h = h_dtype(x, residual, gate)
    w = weight.dtype if weight is not None else (bias.dtype if bias is not None else None)
    if gate is not None:
        return gate_supported(w, out_dtype or h)
    return (residual is None or residual.dtype == h) and kernel_supports(x.dtype, h, w, out_dtype or h)


@torch.library.custom_op("tk::layernorm", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def layernorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rng: torch.Tensor | None,
    eps: float,
    p: float,
    rms: bool | None,
    stats: bool | None = True,
    out_dtype: torch.dtype | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(x, residual, weight, bias, rng, eps, p, rms, out_dtype, gate, stats)
    if p > 0.0 and rng is None:
        rng = philox.draw_seed()
    if forward_kernel_ok(x, residual, weight, bias, out_dtype, gate):
        return _dispatch.kernel("layernorm")(x, residual, weight, bias, rng, eps, p, rms, stats, out_dtype, gate)
    return reference_forward(x, residual, weight, bias, rng, eps, p, rms, stats, out_dtype, gate)


def forward_kernel_ok(x, residual, weight, bias, out_dtype, gate=None) -> bool:
    return (_kernel_ok(x, residual, weight, bias, out_dtype, gate)
            and _dispatch.use_kernel(FAMILY, x, residual, weight, bias, gate))


@layernorm.register_fake
def _forward_fake(x, residual, weight, bias, rng, eps, p, rms, stats=True, out_dtype=None, gate=None):
    _check(x, residual, weight, bias, rng, eps, p, rms, out_dtype, gate, stats)
    hidden = x.shape[-1]
    rows = x.numel() // hidden if stats else 0
    dtype = h_dtype(x, residual, gate)
    y = x.new_empty(x.shape, dtype=out_dtype or dtype)  # contiguous, like the kernel and the reference
    h = x.new_empty(x.shape if (residual is not None or p > 0.0) else (0,), dtype=dtype)
    mean = x.new_empty(0 if rms else rows, dtype=torch.float32)
    rstd = x.new_empty(rows, dtype=torch.float32)
    rng_out = torch.empty(_EMPTY_RNG, dtype=torch.int64, device="cpu")
    return y, h, mean, rstd, rng_out


def _check_backward(dy, dh, h, weight, mean, rstd, rng, p, rms, has_bias, x_dtype, dy2=None, dy3=None, gate=None):
    _dispatch.check_flags("tk::layernorm_backward", rms=rms, has_bias=has_bias)
    check = _dispatch.check
    for name, t in (("dy", dy), ("h", h), ("mean", mean), ("rstd", rstd), ("rng", rng)):
        check(isinstance(t, torch.Tensor), lambda: f"tk::layernorm_backward: {name} must be a tensor", TypeError)
    check(h.dim() >= 1 and h.dtype in DTYPES, lambda: f"tk::layernorm_backward: h must be a float tensor, got {h.dtype}")
    hidden = h.shape[-1]
    rows = h.numel() // hidden if hidden else 0
    check(dy.shape == h.shape and dy.dtype in DTYPES,
          lambda: f"tk::layernorm_backward: dy {tuple(dy.shape)} {dy.dtype} must be a float tensor of h's shape {tuple(h.shape)}")
    check(dh is None or (dh.shape == h.shape and dh.dtype == h.dtype),
          lambda: "tk::layernorm_backward: dh must match h in shape and dtype")
    for name, t in (("dy2", dy2), ("dy3", dy3)):
        check(t is None or (isinstance(t, torch.Tensor) and t.shape == dy.shape and t.dtype == dy.dtype),
              lambda: f"tk::layernorm_backward: {name} must match dy in shape and dtype")
    check(dy3 is None or dy2 is not None, "tk::layernorm_backward: dy3 given without dy2")
    check(weight is None or (tuple(weight.shape) == (hidden,) and weight.dtype in DTYPES),
          lambda: f"tk::layernorm_backward: weight must be a float ({hidden},) tensor, got {tuple(weight.shape)}")
    check(rstd.dtype == torch.float32 and rstd.numel() == rows,
          lambda: f"tk::layernorm_backward: rstd must be fp32 with {rows} elements, got {rstd.dtype} {rstd.numel()}")
    check(rms or (mean.dtype == torch.float32 and mean.numel() == rows),
          lambda: f"tk::layernorm_backward: mean must be fp32 with {rows} elements, got {mean.dtype} {mean.numel()}")
    check(x_dtype is None or x_dtype in DTYPES, lambda: f"tk::layernorm_backward: x_dtype {x_dtype}", TypeError)
    check(gate is None or (gate.shape == h.shape and gate.dtype in DTYPES and gate.device == h.device),
          "tk::layernorm_backward: gate must be a float tensor of h's shape on h's device")
    check(gate is None or (dh is None and p == 0.0), "tk::layernorm_backward: a gated norm takes no dh or dropout")


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
    rms: bool | None,
    has_bias: bool | None,
    x_dtype: torch.dtype | None = None,
    dy2: torch.Tensor | None = None,
    dy3: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dres, dx, dw, db, dgate). With a gate, h is x: dres is empty, dx has x's dtype, dgate the gate's."""
    _check_backward(dy, dh, h, weight, mean, rstd, rng, p, rms, has_bias, x_dtype, dy2, dy3, gate)
    if backward_kernel_ok(dy, dh, h, weight, mean, rstd, x_dtype, dy2, dy3, gate):
        return _dispatch.kernel("layernorm_backward")(dy, dh, h, weight, mean, rstd, rng, p, rms, has_bias, x_dtype,
                                                       dy2, dy3, gate)
    return reference_backward(dy, dh, h, weight, mean, rstd, rng, p, rms, has_bias, x_dtype, dy2, dy3, gate)


def backward_kernel_ok(dy, dh, h, weight, mean, rstd, x_dtype, dy2=None, dy3=None, gate=None) -> bool:
    w = weight.dtype if weight is not None else None
    if gate is not None:
        ok = gate_supported(w, dy.dtype)
    else:
        ok = kernel_supports(x_dtype or h.dtype, h.dtype, w, dy.dtype)
    return ok and _dispatch.use_kernel(FAMILY, dy, dh, h, weight, mean, rstd, dy2, dy3, gate)


@layernorm_backward.register_fake
def _backward_fake(dy, dh, h, weight, mean, rstd, rng, p, rms, has_bias, x_dtype=None, dy2=None, dy3=None, gate=None):
    _check_backward(dy, dh, h, weight, mean, rstd, rng, p, rms, has_bias, x_dtype, dy2, dy3, gate)
    hidden = h.shape[-1]
    if gate is not None:
        w_dtype = weight_dtype(torch.float32, torch.float32, weight.dtype if weight is not None else None, dy.dtype)
        dres, dx, dgate = h.new_empty(0, dtype=torch.float32), h.new_empty(h.shape), gate.new_empty(h.shape)
    else:
        x_dtype = x_dtype or h.dtype
        w_dtype = weight_dtype(x_dtype, h.dtype, weight.dtype if weight is not None else None, dy.dtype)
        dres = h.new_empty(h.shape)
        dx = h.new_empty(h.shape if p > 0.0 or x_dtype != h.dtype else (0,), dtype=x_dtype)
        dgate = h.new_empty(0)
    dw = h.new_empty(hidden if weight is not None else 0, dtype=w_dtype)
    db = h.new_empty(hidden if has_bias else 0, dtype=w_dtype)
    return dres, dx, dw, db, dgate


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, rng, eps, p, rms, stats, _out_dtype, gate = inputs
    _dispatch.check(stats, "tk::layernorm: called with stats=False (no mean/rstd kept), so it has no backward; "
                    "pass stats=True where gradients are needed", RuntimeError)
    y, h, mean, rstd, rng_out = output
    stored_h = residual is not None or p > 0.0
    ctx.save_for_backward(h if stored_h else x, weight, mean, rstd, rng_out, gate)
    ctx.p, ctx.rms, ctx.has_bias, ctx.has_residual, ctx.stored_h = p, rms, bias is not None, residual is not None, stored_h
    ctx.x_dtype, ctx.y_dtype = x.dtype, y.dtype


def _backward(ctx, dy, dh, dmean, drstd, drng):
    h, weight, mean, rstd, rng, gate = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros(h.shape, dtype=ctx.y_dtype, device=h.device)
    if not ctx.stored_h or (dh is not None and dh.numel() == 0):
        dh = None
    dres, dx, dw, db, dgate = torch.ops.tk.layernorm_backward(dy, dh, h, weight, mean, rstd, rng, ctx.p, ctx.rms,
                                                              ctx.has_bias, ctx.x_dtype, gate=gate)
    dx = dx if dx.numel() else dres  # without dropout, and x and h of one dtype, dx is dres
    return (dx, dres if ctx.has_residual else None, dw if weight is not None else None,
            db if ctx.has_bias else None, None, None, None, None, None, None, dgate if gate is not None else None)


layernorm.register_autograd(_backward, setup_context=_setup_context)
