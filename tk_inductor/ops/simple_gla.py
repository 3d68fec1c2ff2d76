"""`tk::simple_gla`: causal linear attention with a scalar decay per head and token (simple GLA, RetNet's form with a
data-dependent decay; flash-linear-attention's `chunk_simple_gla`).

Per batch and head, with q and k (b, l, h, dk), v (b, l, h, dv), the log decay g (b, l, h) and the optional initial
state S_0 (b, h, dk, dv):

    S_t = exp(g_t) S_{t-1} + k_t v_tᵀ          (S_t is (dk, dv))
    o_t = scale · S_tᵀ q_t

Returns (o, final_state): o (b, l, h, dv) contiguous in v's dtype, final_state = S_l (b, h, dk, dv) contiguous fp32
(fp64 for fp64 inputs, reference only). Everything is computed in fp32 (inputs are upcast).

This is the Mamba-2 SSD without its input scaling (ops/ssd.py: the SSD is simple GLA with k·dt for k and dt·A for g,
one group per head), so both run the same chunked scan: the reference is `ssd.chunked_scan` with X = v, a = g, B = k,
C = q, and the CUDA kernels are the SSD's (csrc/kernels/ssd) without A, which read g as the log decay and v unscaled.
Their limits are the SSD's: dk (the state size) 16, 32, 64 or 128, dv (the head dim) a multiple of 64; larger dk run
as blocks of at most 128 key dims whose outputs add, and dv a multiple of 32 is padded (_state_parts.py). With dv 64
only one of a task's two warpgroups has work (a task pairs the 64-wide head-dim tiles of one group, here one head).
Autograd: `tk::simple_gla_backward` returns (dq, dk, dv, dg, dinitial_state), dinitial_state empty without an
initial state; the CUDA kernels are the SSD's backward, with dg = da, the log decay's gradient.
"""
from __future__ import annotations

import torch

from . import _dispatch, _state_parts
from . import ssd as _ssd
from ._state_parts import Axes

KERNEL_FAMILY = "ssd"  # the library whose kernels it runs


def kernel_supports(dk, dv) -> str | None:
    """None if the CUDA kernels compute these head dims, else why not (also used by the matcher)."""
    return _state_parts.supports(dk, dv, n_name="key head dim", p_name="value head dim")


# How the raw ops split when the state runs in parts (_state_parts.py); the states are (b, h, dk, dv).
FORWARD_PARTS = _state_parts.Plan(
    cut={0: Axes(n=-1), 1: Axes(n=-1), 2: Axes(p=-1), 5: Axes(n=-2, p=-1)},
    outs=(("sum", Axes(p=-1)), ("cat", Axes(n=-2, p=-1))))
BACKWARD_PARTS = _state_parts.Plan(
    cut={0: Axes(p=-1), 1: Axes(n=-2, p=-1), 2: Axes(n=-1), 3: Axes(n=-1), 4: Axes(p=-1), 7: Axes(n=-2, p=-1)},
    outs=(("cat", Axes(n=-1)), ("cat", Axes(n=-1)), ("sum", Axes(p=-1)), ("sum", Axes()),
          ("cat", Axes(n=-2, p=-1))))


def _validate(q, k, v, g, scale, initial_state) -> None:
    check = _dispatch.check
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state)):
        if t is None and name == "initial_state":
            continue
        check(isinstance(t, torch.Tensor), lambda: f"tk::simple_gla: {name} must be a tensor", TypeError)
        check(t.dtype in _dispatch.FLOATS, lambda: f"tk::simple_gla: {name} dtype {t.dtype} is not a float type",
              TypeError)
        check(t.device == q.device, lambda: f"tk::simple_gla: {name} is on {t.device}, q on {q.device}")
    check(q.dim() == 4, lambda: f"tk::simple_gla: q must be (b, l, h, dk), got shape {tuple(q.shape)}")
    b, l, h, dk = q.shape
    check(k.shape == q.shape, lambda: f"tk::simple_gla: k {tuple(k.shape)} must have q's shape {tuple(q.shape)}")
    check(v.dim() == 4 and v.shape[:3] == (b, l, h),
          lambda: f"tk::simple_gla: v must be (b, l, h, dv) with (b, l, h) = {(b, l, h)}, got {tuple(v.shape)}")
    check(g.shape == (b, l, h), lambda: f"tk::simple_gla: g must be (b, l, h) = {(b, l, h)}, got {tuple(g.shape)}")
    check(isinstance(scale, float), lambda: f"tk::simple_gla: scale must be a float, got {scale!r}", TypeError)
    if initial_state is not None:
        check(initial_state.shape == (b, h, dk, v.shape[3]),
              lambda: f"tk::simple_gla: initial_state must be (b, h, dk, dv) = {(b, h, dk, v.shape[3])}, "
                      f"got {tuple(initial_state.shape)}")


def simple_gla_reference(q, k, v, g, scale: float, initial_state=None, chunk_size: int = 64):
    """The chunked form in fp32 (differentiable; the backward reference is its autograd)."""
    acc = _ssd._acc(v)
    h0 = None if initial_state is None else initial_state.to(acc).transpose(-1, -2)
    o, state = _ssd.chunked_scan(v.to(acc), g.to(acc), k.to(acc), q.to(acc), h0, chunk_size)
    return (scale * o).to(v.dtype).contiguous(), state.transpose(-1, -2).contiguous()


def simple_gla_recurrence(q, k, v, g, scale: float, initial_state=None):
    """The plain recurrence, token by token in fp32 (the ground truth for tests)."""
    b, l, h, dk = q.shape
    acc = _ssd._acc(v)
    q32, k32, v32, g32 = q.to(acc), k.to(acc), v.to(acc), g.to(acc)
    S = q32.new_zeros(b, h, dk, v.shape[3]) if initial_state is None else initial_state.to(acc)
    outs = []
    for t in range(l):
        S = torch.exp(g32[:, t])[..., None, None] * S + k32[:, t, :, :, None] * v32[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q32[:, t]))
    o = torch.stack(outs, dim=1) if outs else v32.new_zeros(b, 0, h, v.shape[3])
    return o.to(v.dtype), S


def _on_kernel(q, k, v, g, *others) -> bool:
    return (v.dtype != torch.float64 and kernel_supports(q.shape[-1], v.shape[-1]) is None
            and _dispatch.use_kernel(KERNEL_FAMILY, q, k, v, g, *others))


# ---------------------------------------------------------------------------- the ops

SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor g, float scale, Tensor? initial_state=None) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = ("(Tensor grad_o, Tensor grad_state, Tensor q, Tensor k, Tensor v, Tensor g, float scale, "
                   "Tensor? initial_state) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("tk::simple_gla", mutates_args=(), schema=SCHEMA)
def simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
               initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(q, k, v, g, scale, initial_state)
    if _on_kernel(q, k, v, g, initial_state):
        return _state_parts.run(_dispatch.kernel("simple_gla"), (q, k, v, g, scale, initial_state), q.shape[-1],
                                v.shape[-1], FORWARD_PARTS)
    return simple_gla_reference(q, k, v, g, scale, initial_state)


@simple_gla.register_fake
def _(q, k, v, g, scale, initial_state=None):
    _validate(q, k, v, g, scale, initial_state)
    b, l, h, dk = q.shape
    return v.new_empty(v.shape), v.new_empty((b, h, dk, v.shape[3]), dtype=_ssd._acc(v))


@torch.library.custom_op("tk::simple_gla_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def simple_gla_backward(grad_o: torch.Tensor, grad_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, g: torch.Tensor, scale: float, initial_state: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dinitial_state); dinitial_state is empty without an initial state."""
    _validate(q, k, v, g, scale, initial_state)
    b, l, h, dk = q.shape
    state_shape = (b, h, dk, v.shape[3])
    _dispatch.check_grad("tk::simple_gla_backward", "grad_o", grad_o, v.shape, "v's shape")
    _dispatch.check_grad("tk::simple_gla_backward", "grad_state", grad_state, state_shape, "the state's shape")
    if _ssd.BACKWARD_KERNEL_VALIDATED and _on_kernel(q, k, v, g, initial_state, grad_o, grad_state) \
            and _dispatch.has_kernel("simple_gla_backward"):
        return _state_parts.run(_dispatch.kernel("simple_gla_backward"),
                                (grad_o, grad_state, q, k, v, g, scale, initial_state), q.shape[-1], v.shape[-1],
                                BACKWARD_PARTS)
    return _reference_grads(grad_o, grad_state, q, k, v, g, scale, initial_state)


def _reference_grads(grad_o, grad_state, q, k, v, g, scale, initial_state):
    """The reference's gradients, (dq, dk, dv, dg, dinitial_state), dinitial_state empty without an initial state."""
    grads = _dispatch.reference_vjp(lambda *t: simple_gla_reference(*t[:4], scale, t[4]), (q, k, v, g, initial_state),
                                    (grad_o, grad_state))
    return tuple(q.new_empty(0) if t is None else t for t in grads)


@simple_gla_backward.register_fake
def _(grad_o, grad_state, q, k, v, g, scale, initial_state):
    return (*(t.new_empty(t.shape) for t in (q, k, v, g)),
            q.new_empty(0) if initial_state is None else initial_state.new_empty(initial_state.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, g, scale, initial_state = inputs
    ctx.save_for_backward(q, k, v, g, initial_state)
    ctx.scale = scale
    ctx.state_shape = output[1].shape
    ctx.state_dtype = output[1].dtype


def _backward(ctx, grad_o, grad_state):
    q, k, v, g, initial_state = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    if grad_state is None:
        grad_state = v.new_zeros(ctx.state_shape, dtype=ctx.state_dtype)
    dq, dk, dv, dg, dinit = torch.ops.tk.simple_gla_backward(
        grad_o.contiguous(), grad_state.contiguous(), q, k, v, g, ctx.scale, initial_state)
    return dq, dk, dv, dg, None, dinit if initial_state is not None else None


simple_gla.register_autograd(_backward, setup_context=_setup_context)
