"""tk::rotary — rotary position embedding of q (and k) in one launch.

    y = x·cos + rot(x)·sin  on the first rotary_dim = cos.shape[-1] channels; the rest are copied.

rot is NeoX's rotate_half, cat(-x2, x1) (interleaved=False), or GPT-J's pair rotation
(-x[2i+1], x[2i]) (interleaved=True). cos/sin broadcast against x[..., :rotary_dim] (per position,
shared over batch and heads: HF passes (B, N, rotary_dim) unsqueezed). x may be (B, H, N, D) or
(B, N, H, D)-strided: only the last dim must have unit stride. backward=True applies the transposed
map x·cos + rotᵀ(x·sin), the vector-Jacobian product, which reads the partner channel's sin.
Outputs keep x's layout (empty_like), or are contiguous with contiguous=True (what a `cat` gives).

Dtypes: computed in fp32; y has `out_dtype`, by default what eager's `x * cos + rot(x) * sin` gives
(x's and cos's dtypes promoted: fp32 tables on bf16 activations give fp32, as under autocast). An
`out_dtype` below that is the promoted result cast down, rounded once (the matcher fuses such a cast).
"""
from __future__ import annotations

import torch

from . import _dispatch

FAMILY = "rotary"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)


def kernel_supports(x_dtype: torch.dtype, table_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """The (x, cos/sin, y) dtypes the CUDA kernel takes (csrc/kernels/rotary/rotary.h `supported`); the
    reference takes any combination of DTYPES."""
    if x_dtype == table_dtype == out_dtype:
        return x_dtype in DTYPES
    if table_dtype != torch.float32:
        return False
    if x_dtype in _HALF:
        return out_dtype in (torch.float32, x_dtype)
    return x_dtype == torch.float32 and out_dtype in _HALF


def output_dtype(q: torch.Tensor, cos: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    return out_dtype if out_dtype is not None else torch.promote_types(q.dtype, cos.dtype)


def _check(q, k, cos, sin, interleaved, out_dtype=None):
    check = _dispatch.check
    for name, t in (("q", q), ("cos", cos), ("sin", sin)) + ((("k", k),) if k is not None else ()):
        check(isinstance(t, torch.Tensor), lambda: f"tk::rotary: {name} must be a tensor", TypeError)
        check(t.dtype in DTYPES, lambda: f"tk::rotary: {name} dtype must be one of {DTYPES}, got {t.dtype}", TypeError)
        check(t.device == q.device, lambda: f"tk::rotary: {name} is on {t.device}, q on {q.device}")
    check(k is None or k.dtype == q.dtype, lambda: f"tk::rotary: k dtype {k.dtype} must equal q dtype {q.dtype}", TypeError)
    check(sin.dtype == cos.dtype, lambda: f"tk::rotary: sin dtype {sin.dtype} must equal cos dtype {cos.dtype}", TypeError)
    check(out_dtype is None or out_dtype in DTYPES,
          lambda: f"tk::rotary: out_dtype must be one of {DTYPES} or None, got {out_dtype}", TypeError)
    check(1 <= q.dim() <= 4, lambda: f"tk::rotary: q must have 1 to 4 dimensions, got {q.dim()}")
    check(cos.shape == sin.shape,
          lambda: f"tk::rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    rd, d = cos.shape[-1], q.shape[-1]
    check(rd % 2 == 0 and 0 < rd <= d,
          lambda: f"tk::rotary: rotary_dim (cos.shape[-1] = {rd}) must be even and in [2, {d}]")
    if interleaved:
        check(d % 2 == 0, lambda: f"tk::rotary: interleaved rotation needs an even head dim, got {d}")
    for name, x in (("q", q),) + ((("k", k),) if k is not None else ()):
        check(x.dim() == q.dim() and x.shape[-1] == d, lambda: f"tk::rotary: {name} must have q's rank and head dim")
        check(cos.dim() <= x.dim(), lambda: f"tk::rotary: cos has more dimensions than {name}")
        target = tuple(x.shape[:-1]) + (rd,)
        check(_dispatch.broadcasts_to(cos.shape, target),
              lambda: f"tk::rotary: cos/sin {tuple(cos.shape)} do not broadcast to {name}[..., :rotary_dim] {target}")


def _output(x: torch.Tensor, contiguous: bool, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(x.shape, dtype=dtype, device=x.device) if contiguous else torch.empty_like(x, dtype=dtype)


# ---------------------------------------------------------------------------- reference

def _rot(x: torch.Tensor, interleaved: bool, transpose: bool) -> torch.Tensor:
    """rot(x), or rotᵀ(x) = -rot(x) for both rotations (rot is antisymmetric)."""
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        r = torch.stack((-odd, even), dim=-1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        r = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return -r if transpose else r


def reference_one(x, cos, sin, interleaved: bool, backward: bool, contiguous: bool, out_dtype: torch.dtype | None = None):
    rd = cos.shape[-1]
    xr = x[..., :rd].float()
    c, s = cos.float(), sin.float()
    y = xr * c + (_rot(xr * s, interleaved, True) if backward else _rot(xr, interleaved, False) * s)
    out = _output(x, contiguous, output_dtype(x, cos, out_dtype))
    out[..., :rd] = y.to(out.dtype)
    out[..., rd:] = x[..., rd:]
    return out


def reference(q, k, cos, sin, interleaved, backward, contiguous, out_dtype=None):
    qo = reference_one(q, cos, sin, interleaved, backward, contiguous, out_dtype)
    ko = (reference_one(k, cos, sin, interleaved, backward, contiguous, out_dtype) if k is not None
          else q.new_empty(0, dtype=output_dtype(q, cos, out_dtype)))
    return qo, ko


# ---------------------------------------------------------------------------- the op

def _readable(x: torch.Tensor | None, interleaved: bool) -> torch.Tensor | None:
    """x as the kernel reads it: rows of the head dim with any strides but a unit last one, and for the interleaved
    rotation whole (even, odd) pairs: an even-element base and even strides. Anything else is copied. (The kernel
    pads cos/sin to q's rank and copies tables whose strides differ itself.)"""
    if x is None or (x.stride(-1) == 1 and not (interleaved and _odd_pairs(x))):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _odd_pairs(x: torch.Tensor) -> bool:
    return (x.data_ptr() // x.element_size()) % 2 == 1 or any(s % 2 for s in x.stride())


def kernel_ok(q, k, cos, sin, dtype) -> bool:
    return kernel_supports(q.dtype, cos.dtype, dtype) and _dispatch.use_kernel(FAMILY, q, k, cos, sin)


@torch.library.custom_op("tk::rotary", mutates_args=())
def rotary(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool | None,
    backward: bool | None,
    contiguous: bool | None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _dispatch.check_flags("tk::rotary", interleaved=interleaved, backward=backward, contiguous=contiguous)
    _check(q, k, cos, sin, interleaved, out_dtype)
    dtype = output_dtype(q, cos, out_dtype)
    if kernel_ok(q, k, cos, sin, dtype):
        qk, kk = _readable(q, interleaved), _readable(k, interleaved)
        cos, sin = _readable(cos, interleaved), _readable(sin, interleaved)
        qo, ko = _dispatch.kernel("rotary")(qk, kk, cos, sin, interleaved, backward, contiguous, dtype)
        if qk is not q:  # a copied input: give the layout the fake impl promised
            qo = _output(q, contiguous, dtype).copy_(qo)
        if k is not None and kk is not k:
            ko = _output(k, contiguous, dtype).copy_(ko)
        return qo, ko
    return reference(q, k, cos, sin, interleaved, backward, contiguous, dtype)


@rotary.register_fake
def _fake(q, k, cos, sin, interleaved, backward, contiguous, out_dtype=None):
    _dispatch.check_flags("tk::rotary", interleaved=interleaved, backward=backward, contiguous=contiguous)
    _check(q, k, cos, sin, interleaved, out_dtype)
    dtype = output_dtype(q, cos, out_dtype)
    return _output(q, contiguous, dtype), (_output(k, contiguous, dtype) if k is not None else q.new_empty(0, dtype=dtype))


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, interleaved, backward, contiguous, _out_dtype = inputs
    ctx.interleaved, ctx.backward, ctx.has_k, ctx.x_dtype = interleaved, backward, k is not None, q.dtype
    # q/k are only needed for cos/sin gradients (rare: learned rotary tables).
    keep_x = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, q if keep_x else None, k if keep_x else None)


def _backward(ctx, dq, dk):
    cos, sin, q, k = ctx.saved_tensors
    if dq is None:
        dq = torch.zeros_like(q) if q is not None else None
    has_dk = ctx.has_k and dk is not None and dk.numel() > 0
    gq = gk = None
    if dq is not None:
        gq, gk = torch.ops.tk.rotary(dq, dk if has_dk else None, cos, sin, ctx.interleaved, not ctx.backward, False,
                                     ctx.x_dtype)
        gk = gk if has_dk else None
    dcos = dsin = None
    if cos.requires_grad or sin.requires_grad:  # plain PyTorch: y = x·c + rot(x)·s is linear in c and s
        rd = cos.shape[-1]
        dcos = torch.zeros(cos.shape, dtype=torch.float32, device=cos.device)
        dsin = torch.zeros_like(dcos)
        for x, g in ((q, dq), (k, dk if has_dk else None)):
            if x is None or g is None:
                continue
            xr, gr = x[..., :rd].float(), g[..., :rd].float()
            if ctx.backward:  # y = x·c + rotᵀ(x·s): dL/ds = x · rot(g)
                rs = xr * _rot(gr, ctx.interleaved, False)
            else:
                rs = _rot(xr, ctx.interleaved, False) * gr
            dcos += (xr * gr).sum_to_size(cos.shape)
            dsin += rs.sum_to_size(sin.shape)
        dcos, dsin = dcos.to(cos.dtype), dsin.to(sin.dtype)
    return gq, gk, dcos, dsin, None, None, None, None


rotary.register_autograd(_backward, setup_context=_setup_context)


def rotary_half_tables(q, k, cos, sin, interleaved: bool, backward: bool, contiguous: bool, out_dtype=None):
    """tk::rotary with half-width tables, each pair's angle once (gpt-oss's rotary: cos and sin of d / 2 channels
    applied to the two halves): NeoX's rotation with cat(cos, cos) and cat(sin, sin)."""
    return torch.ops.tk.rotary(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1), interleaved, backward,
                               contiguous, out_dtype)


def rotary_complex_tables(q, k, freqs, interleaved: bool, backward: bool, contiguous: bool, out_dtype=None):
    """tk::rotary for the complex spelling (x's consecutive pairs as complex numbers times freqs = cos + i·sin, one
    per pair: Meta's llama, torchtitan, HF Llama-4): GPT-J's interleaved rotation with each part repeated per pair."""
    parts = torch.view_as_real(freqs)
    cos, sin = (parts[..., i].repeat_interleave(2, dim=-1) for i in (0, 1))
    return torch.ops.tk.rotary(q, k, cos, sin, interleaved, backward, contiguous, out_dtype)
