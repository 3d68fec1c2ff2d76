"""`tk::attention_masked`: softmax attention under a mask whose values the compiler cannot see.

tk::attention_masked(q, k, v, mask, scale, softcap=0., with_lse=False) -> (o, lse)
    SDPA with `attn_mask=mask` (bool, True = attend, or additive float, broadcast to (B, Hq, N, M)), the scores
    softcapped first when softcap > 0, for a mask whose values the compiler cannot see: one handed into the
    graph, as after DDP's graph splitting, FSDP's graph breaks or a per-layer `torch.compile`. At run time
    `mask_kind` checks the values once per mask tensor (one device-to-host copy, cached per tensor and version);
    a causal, causal sliding-window or all-visible mask runs the kernel, any other mask runs SDPA with the mask,
    exactly as the original graph did (with a softcap, which SDPA lacks, the reference formulas); then `lse` is
    not computed (zeros) unless `with_lse` (the reference formulas then give o and lse, one batch entry at a time:
    attention sinks need it), and the backward uses the reference formulas in fp32, one batch entry at a time.
    While a CUDA graph is being captured the check cannot run, so the SDPA path is taken. lse is differentiable
    (its gradient enters the backward as tk::attention_backward's grad_lse).
"""
from __future__ import annotations

import collections
import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _dispatch
from . import attention_varlen as _varlen
from .attention import (_as_grads, _empty_out, _kernel_ok, _last_dim_unit, _validate, _validate_backward,
                        _validate_scores, attention, attention_backward, attention_backward_reference,
                        attention_reference, grad_like, lse_grad, sink_rescale)


NEG_BIG = torch.finfo(torch.float16).min  # additive values at or below this vanish in softmax (as the matcher's)
_kinds: WeakIdKeyDictionary = WeakIdKeyDictionary()  # mask tensor (or its base) -> {view key: kind}
# tk::attention_masked calls by path; "value checks" (each waits for the GPU), "proven" (kinds taken from a
# proof instead) and "proofs" (masks proven by the graph that made them)
masked_paths: collections.Counter = collections.Counter()
_warned_sdpa = False  # the SDPA fallback's warning was given


def _mask_key(mask: torch.Tensor, N: int, M: int) -> tuple:
    return (mask.storage_offset(), tuple(mask.shape), mask.stride(), mask.dtype, mask._version, N, M)


# Masks whose kind the graph that made them proved (patterns.attention.output_mask_kinds): a compiled graph's
# output that another graph takes as an input, as across DDP's graph splits or a graph break. Without the proof,
# each step's new mask tensor costs one value check, which waits for the GPU. owner -> (kind, geometry of the
# proven tensor, its version).
_proofs: WeakIdKeyDictionary = WeakIdKeyDictionary()


def prove_mask(mask: torch.Tensor, kind: str) -> None:
    """Record that `mask`'s allowed set over its own last two dims is causal or everything, for every index of
    its leading dims (what the graph that computed it proved; the backend calls this on that graph's output)."""
    if kind not in ("causal", "full"):
        raise ValueError(f"prove_mask: kind must be 'causal' or 'full', got {kind!r}")
    owner = mask._base if mask._base is not None else mask
    _proofs[owner] = (kind, mask.storage_offset(), tuple(mask.shape), mask.stride(), mask.dtype, mask._version)
    masked_paths["proofs"] += 1


def _proven_kind(mask: torch.Tensor, N: int, M: int) -> str | None:
    """The kind of `mask` for an (N, M) box from a proof on the tensor it views, or None (no proof that covers
    it). Taken only for a view whose every (N, M) plane is a top-left corner of a proven plane: the same storage
    offset and last-two strides, leading dims broadcast (stride 0) or walking proven leading dims."""
    owner = mask._base if mask._base is not None else mask
    proof = _proofs.get(owner)
    if proof is None or mask.dim() < 2 or tuple(mask.shape[-2:]) != (N, M):
        return None
    kind, offset, shape, stride, dtype, version = proof
    if (mask._version != version or mask.dtype != dtype or mask.storage_offset() != offset
            or mask.stride()[-2:] != stride[-2:] or N > shape[-2] or M > shape[-1]):
        return None
    free = [(st, sz) for st, sz in zip(stride[:-2], shape[:-2]) if sz > 1]
    for st, sz in zip(mask.stride()[:-2], mask.shape[:-2]):
        if sz == 1 or st == 0:
            continue
        match = next((d for d in free if d[0] == st and d[1] >= sz), None)
        if match is None:
            return None
        free.remove(match)
    return "full" if kind == "full" or M == 1 else "causal"  # a corner of the causal set is causal


def mask_kind(mask: torch.Tensor, N: int, M: int, B: int = 1):
    """"causal" (key j <= query i), "full" (every key), an int w (a causal sliding window: i - w < j <= i, narrower
    than the rows), the interval tables of a mask whose rows each see one run of keys (`Intervals`: every row an
    interval, empty only in a bool mask, the nonempty ones' starts and ends nondecreasing along the rows, the same
    for every head; B is the batch they are built for) or None (anything else) for a bool (True = attend) or
    additive (0 = attend, <= NEG_BIG = hidden) mask that broadcasts to (..., N, M).

    Taken from the proof of the graph that made the mask when there is one (prove_mask), else decided on the
    values, with one device-to-host copy; the answer is cached on the tensor (or the tensor it
    views) together with the view's geometry and version counter, so layers that share one mask pay once and an
    in-place change of the mask is seen."""
    owner = mask._base if mask._base is not None else mask
    key = _mask_key(mask, N, M) + (B,)
    cached = _kinds.get(owner)
    if cached is not None and key in cached:
        return cached[key]
    kind = _proven_kind(mask, N, M)
    if kind is not None:
        masked_paths["proven"] += 1
        _kinds.setdefault(owner, {})[key] = kind
        return kind
    m = mask
    # broadcast (stride-0) and unit leading dims need no second look
    lead = tuple(0 if (size == 1 or stride == 0) else slice(None) for size, stride in zip(m.shape[:-2], m.stride()[:-2]))
    if lead:
        m = m[lead]
    if m.dtype == torch.bool:
        visible, valid = m, None
    else:
        visible = m == 0
        valid = (visible | (m <= NEG_BIG)).all()
    i = torch.arange(N, device=m.device)[:, None]
    j = torch.arange(M, device=m.device)[None, :]
    causal = j <= i
    # a window's widest row holds its width; compared on the device, so that one copy to the host decides all three
    width = visible.sum(-1).amax() if visible.numel() else torch.zeros((), dtype=torch.long, device=m.device)
    is_causal = (visible == causal).all()
    is_window = (visible == (causal & (i - j < width))).all() & (width < min(N, M))
    is_full = visible.all()
    if valid is not None:
        is_causal, is_window, is_full = is_causal & valid, is_window & valid, is_full & valid
    # Row intervals, where every head sees the same mask: `visible` is then its (batch or none, query, key) planes
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if (m4.shape[1] == 1 or m4.stride(1) == 0) and (m4.shape[0] in (1, B) or m4.stride(0) == 0) \
            and visible.shape[-1] == M:
        rows = visible if visible.dim() == 3 else visible[None]
        count, first, stop = _varlen.visible_span(rows)
        last = stop - 1  # a row without keys: [0, -1]
        seen = count > 0
        # A bool mask's row without keys gets o = 0 and no gradient from SDPA (its safe softmax), as from the
        # kernels; an additive mask's hidden row averages every key instead, so there every row must see a key.
        runs = (count == stop - first).all() & (seen.all() if m.dtype != torch.bool else True)
        nondecreasing = _varlen.fill_empty_rows(first, last, M)
        runs = runs & ((nondecreasing[0] == first) | ~seen).all() & ((nondecreasing[1] == last) | ~seen).all()
        if valid is not None:
            runs = runs & valid
    else:
        runs = torch.zeros((), dtype=torch.bool, device=m.device)
    c, w, f, width, r = torch.stack((is_causal, is_window, is_full, width, runs)).long().tolist()
    masked_paths["value checks"] += 1  # each one waits for the GPU
    kind = "full" if f else ("causal" if c else (width if w and width >= 1 else None))
    if kind is None and r:
        kind = _varlen.row_intervals(first.expand(B, N), last.expand(B, N), M)
    _kinds.setdefault(owner, {})[key] = kind
    return kind


def _as_scores_mask(mask: torch.Tensor) -> torch.Tensor:
    """A 0-D or 1-D mask (one value, or one per key) as the 2-D (1, M) view SDPA and the mask checks index."""
    return mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 2 else mask


def _validate_mask(q, k, mask, op: str) -> None:
    check = _dispatch.check
    check(isinstance(mask, torch.Tensor), lambda: f"{op}: mask must be a tensor, got {type(mask).__name__}", TypeError)
    check(mask.dtype == torch.bool or mask.dtype in _dispatch.FLOATS,
          lambda: f"{op}: mask must be bool or floating, got {mask.dtype}", TypeError)
    check(mask.device == q.device, lambda: f"{op}: mask is on {mask.device}, q on {q.device}")
    scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    check(mask.dim() <= 4 and _dispatch.broadcasts_to(mask.shape, scores),
          lambda: f"{op}: mask shape {tuple(mask.shape)} does not broadcast to the scores {scores}")


def _masked_sdpa(q, k, v, mask, scale):
    """What the original graph computed: SDPA with the mask (k/v repeated for GQA, as HF's repeat_kv)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # torch 2.11's cuDNN SDPA faults (misaligned address, a sticky CUDA error) on operands whose base or row strides
    # are not 16-byte multiples instead of choosing another backend: give it aligned copies.
    q, k, v = (t if _rows16(t) else t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _rows16(t: torch.Tensor) -> bool:
    """Unit last stride, a 16-byte aligned base and 16-byte multiple strides (size-1 dims aside)."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        st * t.element_size() % 16 == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def _masked_path(q, k, v, mask, backward: bool = False) -> str | int | None:
    """The kernel's mask kind, or None for the SDPA path (the reference formulas in the backward)."""
    if not _kernel_ok(q, k, v, backward=backward) or torch.cuda.is_current_stream_capturing():
        return None
    global _warned_sdpa
    kind = mask_kind(mask, q.shape[2], k.shape[2], q.shape[0])
    if kind is None and not _warned_sdpa:  # once per process: the kernel could have run, but not this mask
        _warned_sdpa = True
        warnings.warn("tk::attention_masked: the attention mask is neither causal, a causal sliding window, "
                      "all-visible nor one run of keys per row, so SDPA runs instead of the kernel, and the backward "
                      "recomputes the scores per batch entry (slower)", stacklevel=2)
    return kind


def _kind_args(kind: str | int) -> tuple[bool, int]:
    """(causal, window) of tk::attention for a mask kind of `mask_kind`."""
    return (kind != "full", kind if isinstance(kind, int) else 0)


@torch.library.custom_op("tk::attention_masked", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, float softcap=0., "
                                "bool with_lse=False) -> (Tensor o, Tensor lse)")
def attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float = 0.0, with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(q, k, v, scale, "tk::attention_masked")
    _validate_mask(q, k, mask, "tk::attention_masked")
    _validate_scores(False, 0, softcap, "tk::attention_masked")
    if q.numel() == 0:
        return _empty_out(q), q.new_zeros(q.shape[:3], dtype=torch.float32)
    mask = _as_scores_mask(mask)
    kind = _masked_path(q, k, v, mask)
    masked_paths["intervals" if isinstance(kind, _varlen.Intervals) else (kind or "sdpa")] += 1
    if isinstance(kind, _varlen.Intervals):
        q, k, v = map(_last_dim_unit, (q, k, v))
        return _dispatch.kernel("attention")(q, k, v, False, scale, 0, softcap, row_keys=kind.row_keys)
    if kind is not None:
        causal, window = _kind_args(kind)
        return attention(q, k, v, causal, scale, window, softcap)
    o = _empty_out(q)
    if softcap or with_lse:  # SDPA has no softcap nor lse: the reference formulas, one batch entry at a time
        full = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        entries = [attention_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], False, scale, 0, softcap, full[b:b + 1])
                   for b in range(q.shape[0])]
        o.copy_(torch.cat([e[0] for e in entries]))
        if with_lse:
            return o, torch.cat([e[1] for e in entries])
    else:
        o.copy_(_masked_sdpa(q, k, v, mask, scale))
    return o, q.new_zeros(q.shape[:3], dtype=torch.float32)  # lse is not computed on this path


@attention_masked.register_fake
def _(q, k, v, mask, scale, softcap=0.0, with_lse=False):
    _validate(q, k, v, scale, "tk::attention_masked")
    _validate_mask(q, k, mask, "tk::attention_masked")
    _validate_scores(False, 0, softcap, "tk::attention_masked")
    return _empty_out(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tk::attention_masked_backward", mutates_args=(),
                         schema="(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor mask, Tensor o, Tensor lse, "
                                "float scale, float softcap=0., Tensor? grad_lse=None) "
                                "-> (Tensor dq, Tensor dk, Tensor dv)")
def attention_masked_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              mask: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, scale: float,
                              softcap: float = 0.0, grad_lse: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate_backward(grad_o, q, k, v, o, lse, scale)
    g_lse = lse_grad(grad_lse, lse, "tk::attention_masked_backward")
    _validate_mask(q, k, mask, "tk::attention_masked_backward")
    _validate_scores(False, 0, softcap, "tk::attention_masked_backward")
    if q.numel() == 0 or k.numel() == 0:
        return tuple(grad_like(t).zero_() for t in (q, k, v))
    mask = _as_scores_mask(mask)
    # The same values give the same answer as in the forward (cached), so the paths agree, except for a head dim the
    # backward kernels lack: its reference formulas recompute the scores.
    kind = _masked_path(q, k, v, mask, backward=True)
    if isinstance(kind, _varlen.Intervals):
        ins = tuple(map(_last_dim_unit, (grad_o, q, k, v, o)))
        return _dispatch.kernel("attention_backward")(*ins, lse.contiguous(), False, scale, 0, softcap, 0.0, None,
                                                      g_lse, key_rows=kind.key_rows)
    if kind is not None:
        causal, window = _kind_args(kind)
        return attention_backward(grad_o, q, k, v, o, lse, causal, scale, window, softcap, grad_lse=grad_lse)
    # SDPA's gradients for any mask from the reference formulas, one batch entry at a time to bound the memory
    # (this path runs only for masks the kernels do not take; its lse was not computed)
    full = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    per_batch = [attention_backward_reference(grad_o[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], o[b:b + 1], None,
                                              False, scale, full[b:b + 1], 0, softcap,
                                              grad_lse=None if grad_lse is None else grad_lse[b:b + 1])
                 for b in range(q.shape[0])]
    return _as_grads(q, k, v, *(torch.cat(g) for g in zip(*per_batch)))


@attention_masked_backward.register_fake
def _(grad_o, q, k, v, mask, o, lse, scale, softcap=0.0, grad_lse=None):
    _validate_backward(grad_o, q, k, v, o, lse, scale)
    return grad_like(q), grad_like(k), grad_like(v)


def _masked_setup_context(ctx, inputs, output):
    q, k, v, mask, scale, softcap, with_lse = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, mask, o, lse)
    ctx.scale, ctx.softcap = scale, softcap
    if not with_lse:  # zeros on the SDPA path: no gradient to take
        ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _masked_backward(ctx, grad_o, grad_lse):
    q, k, v, mask, o, lse = ctx.saved_tensors
    if grad_o is None and grad_lse is None:
        return (None,) * 7
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv = torch.ops.tk.attention_masked_backward(grad_o, q, k, v, mask, o, lse, ctx.scale, ctx.softcap,
                                                        grad_lse)
    return dq, dk, dv, None, None, None, None


attention_masked.register_autograd(_masked_backward, setup_context=_masked_setup_context)


def attention_masked_sink_adapter(q, k, v, mask, scale: float, softcap: float, sink):
    """Attention sinks (gpt-oss) under a mask handed into the graph (a decode step's, against a KV cache):
    tk::attention_masked's o and lse, rescaled by σ(lse − sink) as attention_sink_adapter does."""
    return sink_rescale(*torch.ops.tk.attention_masked(q, k, v, mask, scale, softcap, True), sink)
