"""`tk::attention_varlen` and its backward: softmax attention under masks whose values are run-time data of the
kind HF builds per batch: key padding (`attention_mask`) and packed sequences (position ids that restart).

Semantics (the kernels of csrc/kernels/attention read the mask as intervals: each query's keys, each key's queries):

    tk::attention_varlen(q, k, v, keep, segments, causal, scale, window=0, softcap=0., uniform_empty=False,
                         dropout_p=0., rng=None) -> (o, lse)
        q, k, v, causal, scale, window, softcap, dropout_p, rng as tk::attention (the same dropout mask), except
        that a window is also taken without causal: a two-sided window, query i sees keys j with |i - j| < window
        (the window - 1 keys on each side: transformers' bidirectional sliding window, ModernBERT's local attention);
        and two optional run-time masks:
        keep (B, M) of any dtype: key j of entry b is visible only where keep[b, j] is nonzero (1 = token,
            0 = padding, left, right or anywhere);
        segments (B, N) integer ids, N == M (self-attention over packed sequences): query i sees key j only when
            both lie in one run of equal consecutive ids of segments[b] (HF's packed-sequence ids are nondecreasing,
            so a run is one sequence).
        That is SDPA with attn_mask = keep[:, None, None, :] & same_run & causal(i, j) (& window). A row with no
        visible key (left padding under a causal mask, an entry whose keep is all zero) gets o = 0 and lse = +inf,
        as SDPA's safe softmax gives; with `uniform_empty` it gets the mean of v over every key instead, which is
        what an eager model's finite additive mask (0 / finfo.min) computes there (every score rounds to the fill,
        so softmax is uniform), gradients included.

Run time: the masks become two interval tables on the device (`Intervals`, cached on the tensors and their
versions, so the layers of a step and the backward share one build). A padding mask costs one device-to-host copy
per keep tensor, which says which entries the intervals describe exactly; the kernel runs every entry, and the
entries it cannot describe (a keep with holes between its first and last visible key) are recomputed by the fp32
reference, one entry at a time (forward and backward). Under `uniform_empty` the rows that see no key (left padding)
are recomputed alone, over every key (the kernel gives them no keys; their backward, lse +inf there, adds nothing):
one more copy, of those rows' indices. Segments alone need no copy. While a CUDA graph is being captured the copy cannot run, so a padded call takes the reference for
every entry.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _dispatch
from .attention import (_as_grads, _empty_out, _kernel_ok, _last_dim_unit, _validate, _validate_backward,
                        _validate_scores, attention_backward_reference, attention_reference, causal_allowed,
                        grad_like, lse_grad, sink_rescale)

OP = "tk::attention_varlen"
_tables: WeakIdKeyDictionary = WeakIdKeyDictionary()  # keep or segments (or its base) -> {key: Intervals}
varlen_paths: dict[str, int] = {"kernel": 0, "reference entries": 0, "uniform rows": 0, "table builds": 0,
                                "value checks": 0}


def _runs(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, end) positions of the run of equal consecutive ids each position lies in, (B, N) each."""
    B, N = segments.shape
    pos = torch.arange(N, device=segments.device).expand(B, N)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    first = torch.where(starts, pos, 0).cummax(1).values
    end = torch.where(ends, pos + 1, N).flip(1).cummin(1).values.flip(1)
    return first, end


def visible_span(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, first, stop) over the last dim of a bool tensor: how many entries are True, the first True one and one
    past the last (first = stop = 0 where none is)."""
    pos = torch.arange(visible.shape[-1], device=visible.device)
    count = visible.sum(-1)
    first = torch.where(count > 0, torch.where(visible, pos, visible.shape[-1]).amin(-1), 0)
    stop = torch.where(count > 0, torch.where(visible, pos + 1, 0).amax(-1), 0)
    return count, first, stop


class Intervals:
    """The kernels' interval tables for (keep, segments) over N queries and M keys: `row_keys` (B, N, 2), the keys
    [x, y] each query may see, and `key_rows` (B, M, 2), the queries each key may be seen by (before the causal and
    window rules, which the kernels apply; a two-sided window, which they do not, is in the tables; both
    nondecreasing, as the kernels need); with keep, per entry on the host, whether the tables describe it exactly
    (`exact`, no holes in keep) and whether some row sees no key (`empty`). B and device: those of the batch, for a
    call without keep and segments (a two-sided window alone)."""

    def __init__(self, keep, segments, N: int, M: int, causal: bool, window: int, B: int = 0, device=None):
        if keep is not None or segments is not None:
            device = (keep if keep is not None else segments).device
            B = (keep if keep is not None else segments).shape[0]
        lo_q = torch.zeros(B, N, dtype=torch.long, device=device)
        hi_q = torch.full((B, N), M - 1, dtype=torch.long, device=device)
        lo_k = torch.zeros(B, M, dtype=torch.long, device=device)
        hi_k = torch.full((B, M), N - 1, dtype=torch.long, device=device)
        if segments is not None:  # N == M: a query's keys and a key's queries are its run
            first, end = _runs(segments)
            lo_q, hi_q, lo_k, hi_k = first, end - 1, first, end - 1
        if window and not causal:  # two-sided: query i and key j within window - 1 of each other
            rows, keys = torch.arange(N, device=device), torch.arange(M, device=device)
            lo_q, hi_q = torch.maximum(lo_q, rows - window + 1), torch.minimum(hi_q, rows + window - 1)
            lo_k, hi_k = torch.maximum(lo_k, keys - window + 1), torch.minimum(hi_k, keys + window - 1)
        self.exact = self.empty = self.empty_rows = self._rows_by_entry = None
        if keep is not None:
            count, start, stop = visible_span(keep != 0)
            pos = torch.arange(M, device=device)
            lo_q = torch.maximum(lo_q, start[:, None])
            hi_q = torch.minimum(hi_q, stop[:, None] - 1)
            before, after = pos[None] < start[:, None], pos[None] >= stop[:, None]
            lo_k = torch.where(before, 0, torch.where(after, N, lo_k))
            hi_k = torch.where(before, -1, torch.where(after, N - 1, hi_k))
            rows = torch.arange(N, device=device)
            lo = torch.maximum(lo_q, rows - window + 1) if window and causal else lo_q
            hi = torch.minimum(hi_q, rows) if causal else hi_q
            exact = count == stop - start
            self.empty_rows = lo > hi  # (B, N): the rows that see no key
            host = torch.stack((exact, self.empty_rows.sum(-1)), -1).tolist()  # the one wait for the device
            varlen_paths["value checks"] += 1
            self.exact = [bool(e) for e, _ in host]
            self.empty = [bool(m) for _, m in host]
            self._empty_counts = [int(m) for _, m in host]
        self.row_keys = torch.stack((lo_q, hi_q), -1).to(torch.int32).contiguous()
        self.key_rows = torch.stack((lo_k, hi_k), -1).to(torch.int32).contiguous()

    def rows_without_keys(self) -> dict[int, torch.Tensor]:
        """entry -> the indices of its rows that see no key, for the entries that have some: one wait for the device
        the first time (the layers of a step and their backward share the tables)."""
        if self._rows_by_entry is None:
            rows = self.empty_rows.nonzero()[:, 1].split([c for c in self._empty_counts if c])
            self._rows_by_entry = dict(zip([b for b, c in enumerate(self._empty_counts) if c], rows))
        return self._rows_by_entry


def fill_empty_rows(first: torch.Tensor, last: torch.Tensor, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) over the rows (last dim) with each row that sees no key (first > last) given the next seen row's
    first and the previous seen row's last (M and -1 where there is none): nondecreasing wherever the seen rows' are,
    and equal to them there."""
    seen = first <= last
    first_f = torch.where(seen, first, M).flip(-1).cummin(-1).values.flip(-1)
    last_f = torch.where(seen, last, -1).cummax(-1).values
    return first_f, last_f


def row_intervals(first: torch.Tensor, last: torch.Tensor, M: int) -> Intervals:
    """The tables of a mask whose every row i of entry b sees exactly the keys [first, last] (B, N) (first > last:
    none; the others nondecreasing along the rows): key j's queries are the rows whose interval holds it
    (tk::attention_masked's run-time masks, such as a static KV cache's). A key's query range may span rows without
    keys: the kernels give those lse = +inf, so P = 0 there."""
    t = Intervals.__new__(Intervals)
    keys = torch.arange(M, device=first.device).expand(first.shape[0], M).contiguous()
    first_f, last_f = fill_empty_rows(first, last, M)
    lo_k = torch.searchsorted(last_f.contiguous(), keys)  # the first row whose interval ends at or after j
    hi_k = torch.searchsorted(first_f.contiguous(), keys, right=True) - 1  # the last row whose interval starts by j
    t.exact = t.empty = t.empty_rows = t._rows_by_entry = None
    t.row_keys = torch.stack((first, last), -1).to(torch.int32).contiguous()
    t.key_rows = torch.stack((lo_k, hi_k), -1).to(torch.int32).contiguous()
    return t


def _geometry(t: torch.Tensor | None) -> tuple:
    return () if t is None else (id(t._base if t._base is not None else t), t.storage_offset(), tuple(t.shape),
                                 t.stride(), t.dtype, t._version)


# The tables of a two-sided window alone, a function of the geometry only: (B, N, M, causal, window, device) ->
# Intervals, the last few kept, so that the layers of a step, their backward and later steps build them once (a
# dozen small device ops each time otherwise: at ModernBERT's sizes the call's host time).
_window_tables: dict = {}
_WINDOW_TABLES_KEPT = 8


def intervals(keep, segments, N: int, M: int, causal: bool, window: int, q: torch.Tensor | None = None) -> Intervals:
    """The Intervals of (keep, segments), cached on the first given tensor (or the one it views) with both tensors'
    geometry and versions and the mask's causal and window (they decide which rows are empty); a two-sided window
    alone: its tables for q's batch, cached by geometry (no value check)."""
    if keep is None and segments is None:
        key = (q.shape[0], N, M, causal, window, q.device)
        tables = _window_tables.get(key)
        if tables is None:
            while len(_window_tables) >= _WINDOW_TABLES_KEPT:
                _window_tables.pop(next(iter(_window_tables)))
            varlen_paths["table builds"] += 1
            tables = _window_tables[key] = Intervals(None, None, N, M, causal, window, q.shape[0], q.device)
        return tables
    primary = keep if keep is not None else segments
    owner = primary._base if primary._base is not None else primary
    key = (_geometry(keep), _geometry(segments), N, M, causal, window)
    cached = _tables.get(owner)
    if cached is None or key not in cached:
        varlen_paths["table builds"] += 1
        _tables[owner] = {key: Intervals(keep, segments, N, M, causal, window)}  # a step's new mask replaces the old
        cached = _tables[owner]
    return cached[key]


def _dense_mask(q, k, keep, segments, causal: bool, window: int, uniform_empty: bool) -> torch.Tensor:
    """The SDPA mask of the op over (B, 1, N, M): bool (True = attend), or with `uniform_empty` the eager model's
    additive one (0 / finfo(float32).min, every rule folded in, so a row without keys is uniform)."""
    B, N, M = q.shape[0], q.shape[2], k.shape[2]
    allowed = torch.ones(B, 1, N, M, dtype=torch.bool, device=q.device)
    if keep is not None:
        allowed = allowed & (keep != 0)[:, None, None, :]
    if segments is not None:
        first, _ = _runs(segments)
        allowed = allowed & (first[:, :, None] == first[:, None, :])[:, None]
    if causal:
        allowed = allowed & causal_allowed(N, M, window, q.device)
    elif window:  # two-sided
        i, j = torch.arange(N, device=q.device)[:, None], torch.arange(M, device=q.device)[None, :]
        allowed = allowed & ((i - j).abs() < window)
    if not uniform_empty:
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min)


def attention_varlen_reference(q, k, v, keep, segments, causal: bool, scale: float, window: int = 0,
                               softcap: float = 0.0, uniform_empty: bool = False, dropout_p: float = 0.0, rng=None,
                               entry0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of the op in fp32 (through attention_reference, one batch entry at a time to bound the memory);
    entry0: the batch entry q[0] is in the op's call (dropout's stream)."""
    mask = _dense_mask(q, k, keep, segments, causal, window, uniform_empty)
    H = q.shape[1]
    outs = [attention_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], False, scale, 0, softcap, mask[b:b + 1],
                                dropout_p, rng, (entry0 + b) * H)
            for b in range(q.shape[0])]
    o = _empty_out(q)
    o.copy_(torch.cat([x[0] for x in outs]))
    return o, torch.cat([x[1] for x in outs])


def attention_varlen_backward_reference(grad_o, q, k, v, keep, segments, o, causal: bool, scale: float,
                                        window: int = 0, softcap: float = 0.0, uniform_empty: bool = False,
                                        dropout_p: float = 0.0, rng=None, entry0: int = 0, grad_lse=None):
    """(dq, dk, dv) of the op in fp32 (P recomputed), one batch entry at a time, in `grad_like` layouts; grad_lse as
    tk::attention_backward's."""
    mask = _dense_mask(q, k, keep, segments, causal, window, uniform_empty)
    H = q.shape[1]
    grads = [attention_backward_reference(grad_o[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], o[b:b + 1], None,
                                          False, scale, mask[b:b + 1], 0, softcap, dropout_p, rng, (entry0 + b) * H,
                                          None if grad_lse is None else grad_lse[b:b + 1])
             for b in range(q.shape[0])]
    return _as_grads(q, k, v, *(torch.cat(g) for g in zip(*grads)))


def _validate_masks(q, k, keep, segments, op: str) -> None:
    check = _dispatch.check
    B, N, M = q.shape[0], q.shape[2], k.shape[2]
    for name, t, rows in (("keep", keep, M), ("segments", segments, N)):
        if t is None:
            continue
        check(isinstance(t, torch.Tensor), lambda: f"{op}: {name} must be a tensor, got {type(t).__name__}", TypeError)
        check(t.device == q.device, lambda: f"{op}: {name} is on {t.device}, q on {q.device}")
        check(t.dim() == 2 and t.shape[0] == B and t.shape[1] == rows,
              lambda: f"{op}: {name} must be (B, {'M' if name == 'keep' else 'N'}) = ({B}, {rows}), got {tuple(t.shape)}")
    check(keep is None or not keep.is_complex(), lambda: f"{op}: keep must be real, got {keep.dtype}", TypeError)
    check(segments is None or not (segments.is_floating_point() or segments.is_complex()),
          lambda: f"{op}: segments must be integer or bool ids, got {segments.dtype}", TypeError)
    check(segments is None or N == M, lambda: f"{op}: segments need as many queries as keys, got N {N}, M {M}")


def _kernel_window(causal: bool, window: int) -> int:
    """The window the kernels apply (a causal one); a two-sided window is in the interval tables."""
    return window if causal else 0


def _reference_entries(tensors, keep, segments, causal: bool, scale: float, window: int, softcap: float,
                       uniform_empty: bool, dropout_p: float, backward: bool = False) -> tuple[Intervals | None, list[int]]:
    """(the kernel's tables, the batch entries the reference must compute), or (None, every entry): the kernel
    cannot run at all (`tensors`: the operands, q, k, v first; `backward`: for the gradients)."""
    q, k = tensors[0], tensors[1]
    everything = list(range(q.shape[0]))
    if (not _kernel_ok(*tensors, backward=backward, scale=scale, softcap=softcap, dropout_p=dropout_p)
            or (keep is not None and torch.cuda.is_current_stream_capturing())):
        return None, everything
    tables = intervals(keep, segments, q.shape[2], k.shape[2], causal, window, q)
    if keep is None:
        return tables, []
    # rows without keys under `uniform_empty` are the kernel's too (`_uniform_rows`), except under dropout, whose
    # stream the row-restricted reference would not reproduce
    return tables, [b for b in everything
                    if not tables.exact[b] or (uniform_empty and dropout_p > 0 and tables.empty[b])]


def _uniform_rows(tables: Intervals | None, ref: list[int], uniform_empty: bool) -> list[tuple[int, torch.Tensor]]:
    """(entry, its rows without keys) that the kernel ran but `uniform_empty` gives the mean of v over every key
    (an eager model's finite fill: all scores equal): those rows are recomputed by the reference over every key, which
    is exact, as each row's attention is independent of the others'."""
    if not uniform_empty or tables is None or tables.empty is None or not any(tables.empty):
        return []
    return [(b, rows) for b, rows in tables.rows_without_keys().items() if b not in ref]


def _uniform_mask(rows: torch.Tensor, M: int) -> torch.Tensor:
    """The eager additive mask of rows that see no key: every score at the fill (softmax uniform over all M keys)."""
    return torch.full((1, 1, rows.numel(), M), torch.finfo(torch.float32).min, device=rows.device)


@torch.library.custom_op(OP, mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor? segments, bool causal, "
                                "float scale, int window=0, float softcap=0., bool uniform_empty=False, "
                                "float dropout_p=0., Tensor? rng=None) -> (Tensor o, Tensor lse)")
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                     segments: torch.Tensor | None, causal: bool, scale: float, window: int = 0, softcap: float = 0.0,
                     uniform_empty: bool = False, dropout_p: float = 0.0,
                     rng: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(q, k, v, scale, OP)
    _validate_masks(q, k, keep, segments, OP)
    _validate_scores(causal, window, softcap, OP, dropout_p, rng, two_sided=True)
    if q.numel() == 0:
        return _empty_out(q), q.new_zeros(q.shape[:3], dtype=torch.float32)
    tables, ref = _reference_entries((q, k, v), keep, segments, causal, scale, window, softcap, uniform_empty,
                                     dropout_p)
    if tables is None:
        varlen_paths["reference entries"] += q.shape[0]
        return attention_varlen_reference(q, k, v, keep, segments, causal, scale, window, softcap, uniform_empty,
                                          dropout_p, rng)
    q, k, v = map(_last_dim_unit, (q, k, v))
    varlen_paths["kernel"] += 1
    o, lse = _dispatch.kernel("attention")(q, k, v, causal, scale, _kernel_window(causal, window), softcap,
                                           dropout_p, rng, row_keys=tables.row_keys)
    for b in ref:
        e = slice(b, b + 1)
        varlen_paths["reference entries"] += 1
        ob, lb = attention_varlen_reference(q[e], k[e], v[e], keep[e], None if segments is None else segments[e],
                                            causal, scale, window, softcap, uniform_empty, dropout_p, rng, b)
        o[e].copy_(ob)
        lse[e].copy_(lb)
    for b, rows in _uniform_rows(tables, ref, uniform_empty):
        varlen_paths["uniform rows"] += rows.numel()
        e = slice(b, b + 1)
        ob, lb = attention_reference(q[e][:, :, rows], k[e], v[e], False, scale, 0, softcap,
                                     _uniform_mask(rows, k.shape[2]))
        o[e, :, rows] = ob.to(o.dtype)
        lse[e, :, rows] = lb
    return o, lse


@attention_varlen.register_fake
def _(q, k, v, keep, segments, causal, scale, window=0, softcap=0.0, uniform_empty=False, dropout_p=0.0, rng=None):
    _validate(q, k, v, scale, OP)
    _validate_masks(q, k, keep, segments, OP)
    _validate_scores(causal, window, softcap, OP, dropout_p, rng, two_sided=True)
    return _empty_out(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(OP + "_backward", mutates_args=(),
                         schema="(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor? segments, "
                                "Tensor o, Tensor lse, bool causal, float scale, int window=0, float softcap=0., "
                                "bool uniform_empty=False, float dropout_p=0., Tensor? rng=None, "
                                "Tensor? grad_lse=None) -> (Tensor dq, Tensor dk, Tensor dv)")
def attention_varlen_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              keep: torch.Tensor | None, segments: torch.Tensor | None, o: torch.Tensor,
                              lse: torch.Tensor, causal: bool, scale: float, window: int = 0, softcap: float = 0.0,
                              uniform_empty: bool = False, dropout_p: float = 0.0,
                              rng: torch.Tensor | None = None, grad_lse: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = OP + "_backward"
    _validate_backward(grad_o, q, k, v, o, lse, scale)
    g_lse = lse_grad(grad_lse, lse, op)
    _validate_masks(q, k, keep, segments, op)
    _validate_scores(causal, window, softcap, op, dropout_p, rng, two_sided=True)
    if q.numel() == 0 or k.numel() == 0:
        return tuple(grad_like(t).zero_() for t in (q, k, v))
    # the forward's masks: their tables are cached, so the same entries take the reference as there
    tables, ref = _reference_entries((q, k, v, grad_o, o, lse), keep, segments, causal, scale, window, softcap,
                                     uniform_empty, dropout_p, backward=True)
    if tables is None:
        return attention_varlen_backward_reference(grad_o, q, k, v, keep, segments, o, causal, scale, window, softcap,
                                                   uniform_empty, dropout_p, rng, grad_lse=grad_lse)
    ins = tuple(map(_last_dim_unit, (grad_o, q, k, v, o)))
    uniform = _uniform_rows(tables, ref, uniform_empty)
    if uniform:  # the kernel's convention for rows without keys (P = 0: they add nothing); recomputed below
        lse = lse.masked_fill(tables.empty_rows[:, None, :], float("inf"))
    dq, dk, dv = _dispatch.kernel("attention_backward")(*ins, lse.contiguous(), causal, scale,
                                                         _kernel_window(causal, window), softcap, dropout_p, rng,
                                                         g_lse, key_rows=tables.key_rows)
    for b, rows in uniform:
        e = slice(b, b + 1)
        gq, gk, gv = attention_backward_reference(grad_o[e][:, :, rows], q[e][:, :, rows], k[e], v[e],
                                                  o[e][:, :, rows], None, False, scale, _uniform_mask(rows, k.shape[2]),
                                                  0, softcap, grad_lse=None if grad_lse is None
                                                  else grad_lse[e][:, :, rows])
        dq[e, :, rows] = gq.to(dq.dtype)
        dk[e] += gk.to(dk.dtype)
        dv[e] += gv.to(dv.dtype)
    for b in ref:
        e = slice(b, b + 1)
        grads = attention_varlen_backward_reference(grad_o[e], q[e], k[e], v[e], keep[e],
                                                    None if segments is None else segments[e], o[e], causal, scale,
                                                    window, softcap, uniform_empty, dropout_p, rng, b,
                                                    None if grad_lse is None else grad_lse[e])
        for dst, g in zip((dq, dk, dv), grads):
            dst[e].copy_(g)
    return dq, dk, dv


@attention_varlen_backward.register_fake
def _(grad_o, q, k, v, keep, segments, o, lse, causal, scale, window=0, softcap=0.0, uniform_empty=False, dropout_p=0.0,
      rng=None, grad_lse=None):
    _validate_backward(grad_o, q, k, v, o, lse, scale)
    return grad_like(q), grad_like(k), grad_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, keep, segments, causal, scale, window, softcap, uniform_empty, dropout_p, rng = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, keep, segments, o, lse, rng)
    ctx.args = (causal, scale, window, softcap, uniform_empty, dropout_p)
    ctx.set_materialize_grads(False)  # lse's gradient is None where lse is unused (attention sinks use it)


def _backward(ctx, grad_o, grad_lse):
    q, k, v, keep, segments, o, lse, rng = ctx.saved_tensors
    if grad_o is None and grad_lse is None:
        return (None,) * 12
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv = torch.ops.tk.attention_varlen_backward(grad_o, q, k, v, keep, segments, o, lse, *ctx.args, rng,
                                                        grad_lse)
    return (dq, dk, dv) + (None,) * 9


attention_varlen.register_autograd(_backward, setup_context=_setup_context)


def attention_varlen_adapter(q, k, v, causal: bool, scale: float, window: int, softcap: float, mask, offset: int,
                             segments, uniform_empty: bool, dropout_p: float = 0.0, chunk: int = 0,
                             chunk_from_pad: bool = False, sink=None, blocks: tuple = ()):
    """tk::attention_varlen's o: keep = the key columns [offset, offset + M) of a (B or 1, M') padding mask or None,
    segments = (B or 1, N) packed-sequence ids or None (one row: every batch entry's), or with chunk > 0 the chunks of
    positions, i // chunk (Llama-4's chunked attention: its sequence ids), with chunk_from_pad counted from each row's
    first unpadded position, (i - L_b) // chunk with L_b the mask's leading False count (HF's mask under left
    padding); dropout_p > 0: the (seed, offset) pair is drawn by a tk::philox_seed node, as in attention_adapter;
    `sink`: attention sinks (gpt-oss), o rescaled by σ(lse − sink) as attention_sink_adapter does; `blocks`: static
    block lengths, each block of positions a sequence of its own (Pixtral's images packed in one sequence)."""
    B, M = q.shape[0], k.shape[2]
    _dispatch.check(mask is None or mask.shape[1] >= offset + M,
                    lambda: f"attention: the padding mask has {mask.shape[1]} columns, the keys need {offset + M}")
    keep = None if mask is None else mask[:, offset:offset + M].expand(B, M)
    if chunk:
        pos = torch.arange(q.shape[2], device=q.device)[None]
        if chunk_from_pad:
            pos = pos - (mask.cumsum(-1) == 0).sum(-1, keepdim=True)
        segments = torch.div(pos, chunk, rounding_mode="floor")
    if blocks:
        segments = torch.tensor([i for i, n in enumerate(blocks) for _ in range(n)], device=q.device)[None]
    if segments is not None:
        segments = segments.expand(B, segments.shape[1])
    rng = torch.ops.tk.philox_seed() if dropout_p > 0 else None
    o, lse = torch.ops.tk.attention_varlen(q, k, v, keep, segments, causal, scale, window, softcap, uniform_empty,
                                           dropout_p, rng)
    return o if sink is None else sink_rescale(o, lse, sink)
