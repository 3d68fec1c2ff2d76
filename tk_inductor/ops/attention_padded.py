"""`tk::attention_padded` and its backward: softmax attention under a key-padding mask (HF's `attention_mask`).

Semantics (the kernels of csrc/kernels/attention take the padding as a per-entry key range, `key_range`):

    tk::attention_padded(q, k, v, keep, causal, scale, window=0, softcap=0., uniform_empty=False) -> (o, lse)
        q, k, v, causal, scale, window, softcap as tk::attention; keep (B, M) of any dtype, nonzero = the key is
        visible to every query of that batch entry (1 = token, 0 = padding, left or right).
        Key j is visible from query i of entry b when keep[b, j] and the causal/window rules of tk::attention allow
        it: SDPA with attn_mask = keep[:, None, None, :] & causal(i, j). A row with no visible key (left padding
        under a causal mask, an entry whose keep is all zero) gets o = 0 and lse = +inf, as SDPA's safe softmax
        gives; with `uniform_empty` it gets the mean of v over every key instead, which is what an eager model's
        finite additive mask (0 / finfo.min) computes there (every score rounds to the fill, so softmax is
        uniform), gradients included.

Run time: the keep tensor becomes one [start, end) key range per entry on the device; with it, one device-to-host
copy per keep tensor (cached on the tensor and its version, so the layers of a step and the backward share one)
says which entries the range describes exactly. The kernel runs every entry, and the entries it cannot describe -- a
keep with holes between its first and last visible key, or rows with no key under `uniform_empty` -- are
recomputed by the fp32 reference, one entry at a time (forward and backward). While a CUDA graph is being captured
the copy cannot run, so every entry takes the reference.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _dispatch
from .attention import (_as_grads, _empty_out, _kernel_ok, _last_dim_unit, _validate, _validate_backward,
                        _validate_scores, attention_backward_reference, attention_reference, grad_like)

OP = "tk::attention_padded"
_ranges: WeakIdKeyDictionary = WeakIdKeyDictionary()  # keep (or its base) -> {view key: KeyRanges}
padded_paths: dict[str, int] = {"kernel": 0, "reference entries": 0, "range checks": 0}


class KeyRanges:
    """Each entry's [start, end) of visible keys (`device`: (B, 2) int32 for the kernels; `host`: the same as a
    list) and whether keep is exactly that range (`exact[b]`, no holes)."""

    def __init__(self, keep: torch.Tensor):
        visible = keep != 0
        B, M = visible.shape
        pos = torch.arange(M, device=keep.device)
        count = visible.sum(-1)
        start = torch.where(visible, pos, M).amin(-1)
        end = torch.where(visible, pos + 1, 0).amax(-1)
        start = torch.where(count > 0, start, 0)
        end = torch.where(count > 0, end, 0)
        self.device = torch.stack((start, end), -1).to(torch.int32).contiguous()
        host = torch.stack((start, end, count), -1).tolist()  # the one wait for the device
        self.host = [(s, e) for s, e, _ in host]
        self.exact = [c == e - s for s, e, c in host]


def key_ranges(keep: torch.Tensor) -> KeyRanges:
    """The KeyRanges of `keep`, cached on the tensor (or the one it views) with the view's geometry and version."""
    owner = keep._base if keep._base is not None else keep
    key = (keep.storage_offset(), tuple(keep.shape), keep.stride(), keep.dtype, keep._version)
    cached = _ranges.get(owner)
    if cached is None or key not in cached:
        padded_paths["range checks"] += 1
        _ranges[owner] = {key: KeyRanges(keep)}  # one view per owner: a step's new mask replaces the old
        cached = _ranges[owner]
    return cached[key]


def has_empty_row(start: int, end: int, N: int, causal: bool, window: int) -> bool:
    """Whether some query row in [0, N) of an entry with visible keys [start, end) sees no key."""
    if N == 0:
        return False
    if end <= start:
        return True
    if causal and start > 0:  # row 0 sees at most key 0
        return True
    return bool(causal and window and N - window >= end)  # the last row's window starts past the keys


def _dense_mask(q, k, keep, causal: bool, window: int, uniform_empty: bool) -> torch.Tensor:
    """The SDPA mask of the op over (B, 1, N, M): bool (True = attend), or with `uniform_empty` the eager model's
    additive one (0 / finfo(float32).min, causal and window folded in, so a row without keys is uniform)."""
    N, M = q.shape[2], k.shape[2]
    allowed = (keep != 0)[:, None, None, :]
    if causal:
        tri = torch.ones(N, M, dtype=torch.bool, device=q.device).tril()
        if window:
            tri = tri.triu(1 - window)
        allowed = allowed & tri
    if not uniform_empty:
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min)


def attention_padded_reference(q, k, v, keep, causal: bool, scale: float, window: int = 0, softcap: float = 0.0,
                               uniform_empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of the op in fp32 (through attention_reference, one batch entry at a time to bound the memory)."""
    mask = _dense_mask(q, k, keep, causal, window, uniform_empty)
    outs = [attention_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], False, scale, 0, softcap, mask[b:b + 1])
            for b in range(q.shape[0])]
    o = _empty_out(q)
    o.copy_(torch.cat([x[0] for x in outs]))
    return o, torch.cat([x[1] for x in outs])


def attention_padded_backward_reference(grad_o, q, k, v, keep, o, causal: bool, scale: float, window: int = 0,
                                        softcap: float = 0.0, uniform_empty: bool = False):
    """(dq, dk, dv) of the op in fp32 (P recomputed), one batch entry at a time, in `grad_like` layouts."""
    mask = _dense_mask(q, k, keep, causal, window, uniform_empty)
    grads = [attention_backward_reference(grad_o[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], o[b:b + 1], None,
                                          False, scale, mask[b:b + 1], 0, softcap)
             for b in range(q.shape[0])]
    return _as_grads(q, k, v, *(torch.cat(g) for g in zip(*grads)))


def _validate_keep(q, k, keep, op: str) -> None:
    check = _dispatch.check
    check(isinstance(keep, torch.Tensor), lambda: f"{op}: keep must be a tensor, got {type(keep).__name__}",
          TypeError)
    check(keep.device == q.device, lambda: f"{op}: keep is on {keep.device}, q on {q.device}")
    check(keep.dim() == 2 and keep.shape[0] == q.shape[0] and keep.shape[1] == k.shape[2],
          lambda: f"{op}: keep must be (B, M) = ({q.shape[0]}, {k.shape[2]}), got {tuple(keep.shape)}")
    check(not keep.is_complex(), lambda: f"{op}: keep must be bool, integer or floating, got {keep.dtype}", TypeError)


def _reference_entries(tensors, keep, causal: bool, window: int, uniform_empty: bool) -> list[int] | None:
    """The batch entries the reference must compute on the kernel path, or None: the kernel cannot run at all
    (`tensors`: the operands, q first)."""
    q = tensors[0]
    if not _kernel_ok(*tensors) or torch.cuda.is_current_stream_capturing():
        return None
    ranges = key_ranges(keep)
    N = q.shape[2]
    return [b for b, ((s, e), exact) in enumerate(zip(ranges.host, ranges.exact))
            if not exact or (uniform_empty and has_empty_row(s, e, N, causal, window))]


@torch.library.custom_op(OP, mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor keep, bool causal, float scale, int window=0, "
                                "float softcap=0., bool uniform_empty=False) -> (Tensor o, Tensor lse)")
def attention_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, causal: bool,
                     scale: float, window: int = 0, softcap: float = 0.0, uniform_empty: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(q, k, v, scale, OP)
    _validate_keep(q, k, keep, OP)
    _validate_scores(causal, window, softcap, OP)
    if q.numel() == 0:
        return _empty_out(q), q.new_zeros(q.shape[:3], dtype=torch.float32)
    ref = _reference_entries((q, k, v), keep, causal, window, uniform_empty)
    if ref is None:
        padded_paths["reference entries"] += q.shape[0]
        return attention_padded_reference(q, k, v, keep, causal, scale, window, softcap, uniform_empty)
    q, k, v = map(_last_dim_unit, (q, k, v))
    padded_paths["kernel"] += 1
    o, lse = _dispatch.kernel("attention")(q, k, v, causal, scale, window, softcap, key_ranges(keep).device)
    for b in ref:
        padded_paths["reference entries"] += 1
        ob, lb = attention_padded_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], keep[b:b + 1], causal, scale, window,
                                            softcap, uniform_empty)
        o[b:b + 1].copy_(ob)
        lse[b:b + 1].copy_(lb)
    return o, lse


@attention_padded.register_fake
def _(q, k, v, keep, causal, scale, window=0, softcap=0.0, uniform_empty=False):
    _validate(q, k, v, scale, OP)
    _validate_keep(q, k, keep, OP)
    _validate_scores(causal, window, softcap, OP)
    return _empty_out(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(OP + "_backward", mutates_args=(),
                         schema="(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor keep, Tensor o, Tensor lse, "
                                "bool causal, float scale, int window=0, float softcap=0., bool uniform_empty=False) "
                                "-> (Tensor dq, Tensor dk, Tensor dv)")
def attention_padded_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              keep: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                              window: int = 0, softcap: float = 0.0, uniform_empty: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = OP + "_backward"
    _validate_backward(grad_o, q, k, v, o, lse, scale)
    _validate_keep(q, k, keep, op)
    _validate_scores(causal, window, softcap, op)
    if q.numel() == 0 or k.numel() == 0:
        return tuple(grad_like(t).zero_() for t in (q, k, v))
    # the forward's keep: its ranges are cached, so the same entries take the reference as there
    ref = _reference_entries((q, k, v, grad_o, o, lse), keep, causal, window, uniform_empty)
    if ref is None:
        return attention_padded_backward_reference(grad_o, q, k, v, keep, o, causal, scale, window, softcap,
                                                   uniform_empty)
    ins = tuple(map(_last_dim_unit, (grad_o, q, k, v, o)))
    dq, dk, dv = _dispatch.kernel("attention_backward")(*ins, lse.contiguous(), causal, scale, window, softcap,
                                                         key_ranges(keep).device)
    for b in ref:
        e = slice(b, b + 1)
        grads = attention_padded_backward_reference(grad_o[e], q[e], k[e], v[e], keep[e], o[e], causal, scale, window,
                                                    softcap, uniform_empty)
        for dst, g in zip((dq, dk, dv), grads):
            dst[e].copy_(g)
    return dq, dk, dv


@attention_padded_backward.register_fake
def _(grad_o, q, k, v, keep, o, lse, causal, scale, window=0, softcap=0.0, uniform_empty=False):
    _validate_backward(grad_o, q, k, v, o, lse, scale)
    return grad_like(q), grad_like(k), grad_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, keep, causal, scale, window, softcap, uniform_empty = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, keep, o, lse)
    ctx.args = (causal, scale, window, softcap, uniform_empty)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_o, _grad_lse):
    q, k, v, keep, o, lse = ctx.saved_tensors
    if grad_o is None:
        return (None,) * 9
    dq, dk, dv = torch.ops.tk.attention_padded_backward(grad_o, q, k, v, keep, o, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * 6


attention_padded.register_autograd(_backward, setup_context=_setup_context)
