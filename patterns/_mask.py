"""Mask analysis shared by the matchers: a symbolic interpreter that *proves* what a mask allows instead of guessing
(calls are named by patterns/_fx.py `name`; its values are patterns/_affine.py's).

`MaskEval` interprets the subgraph that builds a mask as affine functions of the element index (arange + offsets,
broadcasting views, advanced indexing, diff/cumsum of constant steps), predicates that are intersections of
half-planes in (query i, key j), and two-valued selections. It covers tril/triu of ones/full, arange comparisons,
`where`, `masked_fill`, and transformers 5.x's `sdpa_mask`/`eager_mask` including the packed-sequence detection on
in-graph position ids. A run-time 2-D bool mask read at [batch, key] (HF's padding `attention_mask`) becomes a
padding literal, and run-time packed-sequence ids (a cumsum of a bool) compared at the query and the key a
same-sequence literal. A symbolic size (a KV cache's length under dynamic shapes, which offsets a decode step's
query positions) is a constant of the mask, kept as its sympy expression and decided on the box of scores, whose
sizes are symbolic too. `_mask_kind` decides whether an allowed set is exactly {j <= i} (causal, top-left),
{i - w < j <= i} (a causal sliding window) or everything, each with or without a padding literal, and names what
else it is (a diagonal offset, a mask varying over batch or heads); such bounds at a symbolic offset (a causal mask
aligned to the end of a longer cache) raise `RunTimeRuns`, whose rows are runs that the op can read at run time. A
mask built otherwise from a graph input or with an op outside this vocabulary raises `Keep` with the reason.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from tk_inductor.rewrite import example

from ._affine import (Abs, Aff, _and, _as_pred, _as_sel, _coefs, _compare, complement, _drop_unit_axes, FALSE, Gather,
                      FloorDiv, _is_int, _linear, Neg, nonnegative, _not, _or, _plane, Pred, _remap, run_axis, Sel, _shift,
                      _simplify, TRUE)
from ._fx import arg as _arg
from ._fx import Keep, eq, number, rank, shape, storage_of, writes_by_storage
from ._fx import name as _name
from ._varlen import _input_of, leftpad_axis, leftpad_source, literals, _padding_source, _position_source, \
    _segment_source


_NEG_BIG = torch.finfo(torch.float16).min  # fill values at or below this vanish in softmax


# ---------------------------------------------------------------------------- node vocabulary

class _MaskEval:
    """Symbolic values of the nodes that build a mask (memoised per graph)."""

    def __init__(self):
        self.memo: dict[fx.Node, Any] = {}

    def __call__(self, x):
        if not isinstance(x, fx.Node):
            n = number(x)
            if n is None:
                raise Keep(f"mask uses a non-constant {type(x).__name__}")
            return Aff((), n)
        if x not in self.memo:
            try:
                v = self._eval(x)
            except Keep as e:
                v = e
            self.memo[x] = v
        v = self.memo[x]
        if isinstance(v, Keep):
            raise v
        return v

    def _eval(self, node: fx.Node):
        # A tensor written in place (`mask[...] = 0`, `masked_fill_`, through any view of it) holds other values
        # than the op that made it: its value is not the node's.
        writers = writes_by_storage(node.graph).get(storage_of(node))
        if writers:
            raise Keep(f"`{node.name}` is written in place (`{writers[0].name}`), which the mask analysis does not "
                       "model")
        n = number(node)
        if n is not None and not isinstance(example(node), torch.Tensor):
            return Aff((), n)  # a SymInt/SymFloat with a fixed value
        if isinstance(example(node), torch.SymInt):
            return Aff((), example(node).node.expr)  # a symbolic size: a constant of the mask, not an index
        if isinstance(example(node), (torch.SymFloat, torch.SymBool)):
            raise Keep(f"it depends on the symbolic value `{node.name}`")
        if node.op == "placeholder":
            raise Keep(f"it is built from graph input `{node.target}` (a padding/custom mask or "
                        "position ids whose values are unknown at compile time)")
        if node.op == "get_attr":
            raise Keep(f"it is a constant tensor `{node.target}` whose structure is not analysed")
        name = _name(node)
        handler = getattr(self, f"_op_{name}", None) if name else None
        if handler is None:
            what = name or (node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target))
            raise Keep(f"it uses `{what}`, which the mask analysis does not model")
        v = handler(node)
        v = _drop_unit_axes(v, shape(node) or ())
        if isinstance(example(node), torch.Tensor):
            dtype = example(node).dtype
            if isinstance(v, Neg):
                if dtype != torch.bool:
                    v = Sel(v.pred, 0, 1)
            elif dtype == torch.bool and not isinstance(v, Pred):
                v = _as_pred(v)
            elif dtype != torch.bool and isinstance(v, Pred):
                v = _simplify(Sel(v, 1, 0))
        return v

    # --- constants and index sources
    def _op_arange(self, node):
        args, kw = list(node.args), node.kwargs
        if len(args) <= 1:  # arange(end) or arange(start=..., end=...)
            start, step = kw.get("start", 0), kw.get("step", 1)
        else:
            start, step = args[0], (args[2] if len(args) > 2 else kw.get("step", 1))
        start, step = _int_constant(start), number(step)
        if start is None or step is None or isinstance(start, bool):
            raise Keep("mask uses arange with a symbolic start/step")
        return Aff(_coefs({-1: step}), start)

    def _const(self, fill):
        v = number(fill)
        if v is None:
            raise Keep("mask fill value is not a constant")
        return Aff((), v)

    def _op_ones(self, node):
        return Aff((), 1)

    _op_ones_like = _op_new_ones = _op_ones

    def _op_zeros(self, node):
        return Aff((), 0)

    _op_zeros_like = _op_new_zeros = _op_zeros

    def _op_full(self, node):  # full(size, fill), full_like(x, fill), x.new_full(size, fill)
        return self._const(_arg(node, 2 if _name(node) == "new_full" else 1, "fill_value"))

    _op_full_like = _op_new_full = _op_full

    def _op_tensor(self, node):
        return self._const(_arg(node, 0, "data"))

    # --- elementwise
    def _op_add(self, node):
        if node.kwargs.get("alpha", 1) != 1:
            raise Keep("mask uses add with alpha")
        return _linear("add", self(node.args[0]), self(node.args[1]))

    def _op_sub(self, node):
        if node.kwargs.get("alpha", 1) != 1:
            raise Keep("mask uses sub with alpha")
        return _linear("sub", self(node.args[0]), self(node.args[1]))

    def _op_mul(self, node):
        x, y = self(node.args[0]), self(node.args[1])
        if isinstance(x, Pred) and isinstance(y, Pred):
            return _and(x, y)
        return _linear("mul", x, y)

    def _op_div(self, node):
        if node.kwargs.get("rounding_mode") is not None:
            raise Keep("mask uses a rounding division")
        return _linear("div", self(node.args[0]), self(node.args[1]))

    def _op_neg(self, node):
        return _linear("mul", self(node.args[0]), Aff((), -1))

    def _op_floordiv(self, node):
        x, by = self(node.args[0]), number(node.args[1])
        if not isinstance(x, Aff) or not isinstance(by, int) or isinstance(by, bool) or by <= 0:
            raise Keep("mask uses a floor division other than of an index expression by a positive int")
        return Aff((), x.c // by) if not x.coefs else FloorDiv(x, by)

    def _op_abs(self, node):
        v = self(node.args[0])
        if not isinstance(v, Aff):
            raise Keep("mask takes the absolute value of something other than an index expression")
        return Aff((), abs(v.c)) if not v.coefs else Abs(v)

    def _cmp(self, node, op):
        return _compare(op, self(node.args[0]), self(node.args[1]))

    def _op_le(self, node):
        return self._cmp(node, "le")

    def _op_lt(self, node):
        return self._cmp(node, "lt")

    def _op_ge(self, node):
        return self._cmp(node, "ge")

    def _op_gt(self, node):
        return self._cmp(node, "gt")

    def _op_eq(self, node):
        return self._cmp(node, "eq")

    def _op_ne(self, node):
        return self._cmp(node, "ne")

    def _op_and(self, node):
        return _and(_as_pred(self(node.args[0])), _as_pred(self(node.args[1])))

    def _op_or(self, node):
        return _or(_as_pred(self(node.args[0])), _as_pred(self(node.args[1])))

    def _op_not(self, node):
        v = self(node.args[0])
        return v.pred if isinstance(v, Neg) else complement(_as_pred(v))

    def _op_where(self, node):
        if len(node.args) + len(node.kwargs) < 3:
            raise Keep("mask uses one-argument where")
        cond = self(_arg(node, 0, "condition"))
        a, b = self(_arg(node, 1, "input")), self(_arg(node, 2, "other"))
        if isinstance(cond, Neg):  # where(not p, a, b) = where(p, b, a)
            cond, a, b = cond.pred, b, a
        cond = _as_pred(cond)
        if isinstance(a, Aff) and isinstance(b, Aff) and not a.coefs and not b.coefs:
            return _simplify(Sel(cond, a.c, b.c))
        if isinstance(a, Pred) and isinstance(b, Aff) and not b.coefs and not b.c:
            return _and(cond, a)
        raise Keep("mask selects between non-constant values")

    def _op_masked_fill(self, node):
        x = self(node.args[0])
        m = self(_arg(node, 1, "mask"))
        v = self(_arg(node, 2, "value"))
        if not (isinstance(v, Aff) and not v.coefs):
            raise Keep("mask fill value is not a constant")
        if isinstance(m, Neg):  # filled outside m.pred: what is left is m.pred
            if isinstance(x, Aff) and not x.coefs:
                return _simplify(Sel(m.pred, x.c, v.c))
            if isinstance(x, Pred) and not v.c:
                return _and(x, m.pred)
            raise Keep("mask fills a non-constant tensor")
        p = _as_pred(m)
        if isinstance(x, Aff) and not x.coefs:
            return _simplify(Sel(p, v.c, x.c))
        if isinstance(x, Pred) and not v.c:  # a bool mask with more positions cleared
            return _and(x, _not(p))
        raise Keep("mask fills a non-constant tensor")

    def _tri(self, node, lower: bool):
        x = self(node.args[0])
        d = number(_arg(node, 1, "diagonal", 0))
        if d is None:
            raise Keep("tril/triu with a symbolic diagonal")
        # tril keeps key j <= query i + d  (i - j + d >= 0); triu keeps j >= i + d  (j - i - d >= 0)
        keep = _plane({-2: 1, -1: -1}, d) if lower else _plane({-2: -1, -1: 1}, -d)
        if isinstance(x, Pred):
            return _and(x, keep)
        s = _as_sel(x)
        if s.b != 0 and s.pred != TRUE and s.a != s.b:
            raise Keep("tril/triu of a non-constant mask")
        if s.pred == TRUE or s.a == s.b:
            return _simplify(Sel(keep, s.a, 0))
        return _simplify(Sel(_and(s.pred, keep), s.a, 0))

    def _op_tril(self, node):
        return self._tri(node, True)

    def _op_triu(self, node):
        return self._tri(node, False)

    # --- casts and views
    def _op_to(self, node):
        return self(node.args[0])

    _op_type = _op_type_as = _op_float = _op_half = _op_bfloat16 = _op_double = _op_to
    _op_bool = _op_long = _op_int = _op_contiguous = _op_clone = _op_detach = _op_to

    def _op_expand(self, node):
        return self(node.args[0])  # trailing axes keep their negative numbers

    def _by_unit_dims(self, node):
        """view/reshape/unsqueeze/squeeze/flatten that only add or remove size-1 dims."""
        src = node.args[0]
        v = self(src)
        ins, outs = shape(src) or (), shape(node) or ()
        big_in = [i for i, s in enumerate(ins) if not eq(s, 1)]
        big_out = [i for i, s in enumerate(outs) if not eq(s, 1)]
        if len(big_in) != len(big_out) or not all(eq(ins[a], outs[b]) for a, b in zip(big_in, big_out)):
            raise Keep("mask reshape merges or splits dimensions")
        return _remap(v, {a - len(ins): b - len(outs) for a, b in zip(big_in, big_out)})

    _op_view = _op_reshape = _op_unsqueeze = _op_squeeze = _op_flatten = _by_unit_dims

    def _op_transpose(self, node):
        nd = rank(node)
        a, b = (int(x) % nd - nd for x in node.args[1:3])
        return _remap(self(node.args[0]), {a: b, b: a, **{x: x for x in range(-nd, 0) if x not in (a, b)}})

    def _op_permute(self, node):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        nd = len(dims)
        return _remap(self(node.args[0]), {int(d) % nd - nd: i - nd for i, d in enumerate(dims)})

    def _op_getitem(self, node):
        src, index = node.args
        if isinstance(example(src), (list, tuple)):
            raise Keep("mask indexes a tuple")
        index = index if isinstance(index, tuple) else (index,)
        advanced = bool(index) and all(isinstance(i, fx.Node) and isinstance(example(i), torch.Tensor) for i in index)
        if advanced and leftpad_source(src) is not None:
            return self._leftpad_read(src, index)
        if advanced and (_padding_source(src) or _segment_source(src) or _position_source(src)):
            try:
                self(src)  # values the analysis knows (in-graph position ids, say) are read as they are
            except Keep:
                return self._runtime_read(src, index)
        v = self(src)
        ins, outs = shape(src) or (), shape(node) or ()
        if advanced:
            return self._advanced(v, ins, outs, index)
        if any(isinstance(i, fx.Node) and isinstance(example(i), torch.Tensor) for i in index):
            raise Keep("mask mixes advanced and basic indexing")
        used = sum(1 for i in index if i is not None and i is not Ellipsis)
        expanded = []
        for i in index:
            expanded.extend([slice(None)] * (len(ins) - used) if i is Ellipsis else [i])
        if Ellipsis not in index:
            expanded += [slice(None)] * (len(ins) - used)
        mapping, shift, fixed = {}, {}, {}
        d_in = d_out = 0
        for i in expanded:
            if i is None:
                d_out += 1
                continue
            if isinstance(i, slice):
                start = 0 if i.start is None else number(i.start)
                step = 1 if i.step is None else number(i.step)
                if start is None or step is None or start < 0:
                    raise Keep("mask slices from a symbolic or negative start")
                mapping[d_in - len(ins)] = d_out - len(outs)
                shift[d_in - len(ins)] = (start, step)
                d_out += 1
            else:
                idx = number(i)
                if idx is None or isinstance(idx, bool) or idx < 0:
                    raise Keep("mask indexes with a symbolic or negative integer")
                fixed[d_in - len(ins)] = idx
            d_in += 1

        def fn(coefs, c):
            out = {}
            for a, k in coefs.items():
                if a in fixed:
                    c += k * fixed[a]
                else:
                    start, step = shift[a]
                    c += k * start
                    out[mapping[a]] = out.get(mapping[a], 0) + k * step
            return out, c

        return _shift(v, fn)

    def _runtime_read(self, src, index):
        """src[rows, cols] of a run-time 2-D tensor at the indices' affine values: for a bool mask (HF's
        `attention_mask[batch_idx, kv_idx]`) a padding literal, for packed-sequence ids a `Gather` to compare, for
        position ids (HF evaluates its causal and window rules on them when sequences are packed) the column index
        plus the sequence's unknown offset (`run_axis`)."""
        if len(index) != 2:
            raise Keep("mask indexes a run-time mask with other than two index tensors")
        forms = []
        for i in index:
            iv = self(i)
            if not isinstance(iv, Aff) or not all(_is_int(k) for _, k in iv.coefs) or not _is_int(iv.c):
                raise Keep("mask indexes a run-time mask with non-integer indices")
            if number(iv.c) is None:  # a sliding cache's keys read the padding mask from a symbolic position
                raise RunTimeRuns("a run-time mask is read at a symbolic offset")
            forms.append((iv.coefs, int(iv.c)))
        if _segment_source(src):
            return Gather(src, forms[0], forms[1])
        if _padding_source(src):
            return Pred(pads=frozenset({("keep", src, forms[0], forms[1])}))
        (col, c), row = forms[1], forms[0]
        if row not in ((((-4, 1),), 0), ((), 0)) or len(col) != 1 or col[0][1] != 1:
            raise Keep("position ids are not read at [batch, query or key]")
        return Aff(_coefs({col[0][0]: 1, run_axis(_input_of(src)): 1}), c)

    def _leftpad_read(self, src, index):
        """left_padding[batch] of a padding mask's left-padding count (`leftpad_source`): the Aff of its pseudo-axis,
        which chunk ids compare (patterns/_varlen.py literals)."""
        iv = self(index[0]) if len(index) == 1 else None
        one = eq(example(src).shape[0], 1)  # one batch entry: its index is 0 whatever the form
        if not isinstance(iv, Aff) or iv.c != 0 or not (iv.coefs == ((-4, 1),) or (iv.coefs == () and one)):
            raise Keep("a left-padding count is read at other than the batch index")
        return Aff(((leftpad_axis(leftpad_source(src)), 1),))

    def _advanced(self, v, ins, outs, index):
        """x[i0, i1, ...] with integer index tensors for every dim: substitute the indices' values."""
        if len(index) != len(ins):
            raise Keep("mask uses partial advanced indexing")
        subs = {}
        for pos, i in enumerate(index):
            iv = self(i)
            if not isinstance(iv, Aff) or not all(_is_int(k) for _, k in iv.coefs) or not _is_int(iv.c):
                raise Keep("mask indexes with non-integer indices")
            subs[pos - len(ins)] = iv

        def fn(coefs, c):
            out = {}
            for a, k in coefs.items():
                s = subs[a]
                c += k * s.c
                for b, kb in s.coefs:
                    out[b] = out.get(b, 0) + k * kb
            return out, c

        # constant dims keep their value whatever the index: only the coefficients move
        return _shift(v, fn)

    def _op_diff(self, node):
        x = self(node.args[0])
        dim = number(_arg(node, 2, "dim", -1))
        n = number(_arg(node, 1, "n", 1))
        prepend, append = node.kwargs.get("prepend"), node.kwargs.get("append")
        nd = rank(node.args[0])
        if n != 1 or append is not None or dim is None or not isinstance(x, Aff):
            raise Keep("mask uses a diff it cannot model")
        ax = dim % nd - nd
        coefs = dict(x.coefs)
        step = coefs.pop(ax, 0)
        if prepend is not None:
            # first element: x[..., 0] - prepend must equal the interior step
            first = _linear("sub", Aff(_coefs(coefs), x.c), self(prepend))
            if first.coefs or first.c != step:
                raise Keep("mask uses a diff whose first element differs")
        return Aff((), step)

    def _op_cumsum(self, node):
        x = self(node.args[0])
        if isinstance(x, Pred):
            x = _as_sel(x)
            if x.pred not in (TRUE, FALSE) and x.a != x.b:
                raise Keep("mask uses a cumsum of a non-constant")
            x = Aff((), int(x.a) if x.pred != FALSE else int(x.b))
        if not isinstance(x, Aff) or x.coefs:
            raise Keep("mask uses a cumsum of a non-constant")
        nd = rank(node)
        ax = number(_arg(node, 1, "dim")) % nd - nd
        return Aff(_coefs({ax: x.c}), x.c)  # running sum of a constant c: c·(index + 1)


# ---------------------------------------------------------------------------- mask -> causal?

_CAUSAL = frozenset({(_coefs({-2: 1, -1: -1}), 0)})  # key j <= query i


def _int_constant(x):
    """x as an int, or the sympy expression of a symbolic int (a size); None for anything else."""
    n = number(x)
    if n is not None:
        return n
    ex = example(x)
    return ex.node.expr if isinstance(ex, torch.SymInt) else None


def _on_box(planes, sizes: dict) -> set | None:
    """The half-planes that still cut the (query, key) box [0, N) x [0, M); None if one is empty there.

    Coefficients on axes of size 1 vanish (their index is 0), planes that hold on the whole box
    (their minimum over it is >= 0, needs static sizes for negative coefficients) are dropped, and
    what remains is renormalised, so equal regions of the box compare equal."""
    out = set()
    for coefs, c in planes:
        d = {a: k for a, k in coefs if not eq(sizes[a], 1)}
        sz = {a: _int_constant(sizes[a]) for a in d}  # symbolic sizes as sympy expressions
        if all(k > 0 or sz[a] is not None for a, k in d.items()):
            low = c + sum(k * (sz[a] - 1) for a, k in d.items() if k < 0)
            high = c + sum(k * (sz[a] - 1) for a, k in d.items() if k > 0) if all(v is not None for v in sz.values()) else None
            if nonnegative(low):
                continue  # holds everywhere
            if high is not None and nonnegative(high) is False:
                return None  # holds nowhere
        plane = _plane(d, c)
        if plane.false:
            return None
        out |= plane.planes
    return out


class MaskKind(NamedTuple):
    """What a proven mask allows: `causal` (key j <= query i, top-left) or everything, and within causal a sliding
    `window` > 0 (also j > i - window, as transformers' sliding-window masks), 0 for none; without causal a window is
    two-sided (|i - j| < window, transformers' bidirectional sliding window); with `pad` = (mask node,
    offset) only the keys j where the run-time (B or 1, M') bool `mask[b, offset + j]` holds (a padding mask), with
    `segments` (a (B or 1, N) node of packed-sequence ids) only the keys of the query's sequence, and
    `uniform_empty` when a padded mask's fill is finite (a row with no visible key then averages v, as in eager), and
    with `chunk` > 0 only the keys of the query's chunk of positions (i // chunk == j // chunk: Llama-4's chunked
    attention), counted from each row's first unpadded key with `chunk_from_pad` ((i - L_b) // chunk, L_b the
    number of leading False entries of `pad`'s row b, as HF's mask under left padding); `blocks`: the lengths of
    static blocks of positions that see only each other (`static_blocks`)."""

    causal: bool
    window: int = 0
    pad: tuple | None = None
    segments: Any = None
    uniform_empty: bool = False
    chunk: int = 0
    chunk_from_pad: bool = False
    blocks: tuple = ()


class RunTimeRuns(Keep):
    """A mask the prover cannot reduce to a kernel's compile-time kind, whose rows nonetheless each see one run of
    keys whatever its symbolic sizes (causal or windowed bounds with a symbolic offset): `tk::attention_masked`
    can read it at run time (interval tables)."""


def _mask_kind(allowed: Pred, score_shape: tuple, finite: bool | None = None) -> MaskKind:
    """The kind of an allowed set, decided on the actual box of scores: for one query causal means "key 0 only",
    for one key it means "everything" (reported as non-causal, the cheaper kernel path), and a window that reaches
    past the box is plain causal; run-time literals become `pad` and `segments`, and `finite` says the hidden entries
    were filled with a finite value (True), -inf (False) or are a bool mask's (None). Raises Keep for any other
    set."""
    pad, segments, chunk, from_pad = literals(allowed, score_shape)
    kind = _planes_kind(Pred(allowed.planes, allowed.false), score_shape)
    return kind._replace(pad=pad, segments=segments, uniform_empty=bool(pad is not None and finite), chunk=chunk,
                         chunk_from_pad=from_pad)


def _planes_kind(allowed: Pred, score_shape: tuple) -> MaskKind:
    if allowed.false:
        raise Keep("the mask hides every key")
    for coefs, _ in allowed.planes:
        if {a for a, _ in coefs} - {-1, -2}:
            raise Keep("the mask varies over batch or heads (padding-like)")
    sizes = {-2: score_shape[-2], -1: score_shape[-1]}
    planes = _on_box(allowed.planes, sizes)
    causal = _on_box(_CAUSAL, sizes)
    if planes is None:
        raise Keep("the mask hides every key")
    if not planes:
        return MaskKind(False)
    diagonal, anti = _coefs({-2: 1, -1: -1}), _coefs({-2: -1, -1: 1})
    if any(not isinstance(c, int) for _, c in planes):
        # bounds on j - i and on j alone leave each row one run of keys (a causal mask aligned to the end of a
        # longer key sequence, as with several new queries against a cache; a sliding cache's first and last keys)
        if all(coefs in (diagonal, anti, _coefs({-1: 1}), _coefs({-1: -1})) for coefs, _ in planes):
            raise RunTimeRuns("the mask's bounds depend on a symbolic size (each row one run of keys: a causal mask "
                              "aligned to the end of a longer key sequence, or a sliding cache's window)")
        raise Keep("the mask's bounds depend on a symbolic size")
    if planes == causal:
        return MaskKind(True)
    for coefs, c in planes:
        if coefs == diagonal and c != 0 and len(planes) == 1:
            raise Keep(f"causal mask with a diagonal offset of {c} (not top-left aligned)")
    rest = planes - causal
    if causal <= planes and len(rest) == 1:
        (coefs, c), = rest
        if coefs == anti and c >= 0:  # j - i + c >= 0: j > i - (c + 1)
            return MaskKind(True, c + 1)
    if len(planes) == 2 and {co for co, _ in planes} == {diagonal, anti}:
        (_, c1), (_, c2) = planes
        if c1 == c2 and c1 >= 0:  # |i - j| <= c: a two-sided window (transformers' bidirectional sliding window)
            return MaskKind(False, c1 + 1)
    if (diagonal, 0) in planes and any(co == anti for co, _ in planes):
        raise Keep("sliding-window mask in an unsupported form")
    raise Keep("the mask is not a plain causal mask")


def triangle(mask: Any, shape: tuple, diagonal: int = 0, negated: bool = False) -> bool:
    """Whether `mask` is tril(ones(N, M), diagonal) on the (..., N, M) box `shape` (1/True exactly where key
    j <= query i + diagonal, 0/False elsewhere, the same for every leading index), or with `negated` its complement
    (~tril: what masked_fill hides). Proven by the mask analysis, so any spelling it models counts: tril/triu of
    ones, arange comparisons, `where`, casts. For the multiplicative and masked_fill masks of linear attention and
    the SSD's segment sums."""
    try:
        s = _as_sel(_MaskEval()(mask))
        if number(s.a) == 1 and number(s.b) == 0:
            ones = s.pred
        elif number(s.a) == 0 and number(s.b) == 1:
            ones = _not(s.pred)
        else:
            return False
        region = _not(ones) if negated else ones  # where the mask must be 1 for tril(ones, diagonal)
    except Keep:
        return False
    if region.false or any({a for a, _ in coefs} - {-1, -2} for coefs, _ in region.planes):
        return False  # hides everything, or varies over batch or heads
    sizes = {-2: shape[-2], -1: shape[-1]}
    want = _on_box({(_coefs({-2: 1, -1: -1}), diagonal)}, sizes)
    return _on_box(region.planes, sizes) == want


def _fill_ok(v) -> bool:
    return isinstance(v, (int, float)) and (v == -math.inf or (math.isfinite(v) and v <= _NEG_BIG))


def _additive_allowed(v) -> Pred:
    """The allowed set of an additive mask (0 where allowed, a vanishing value elsewhere)."""
    if isinstance(v, Pred):
        raise Keep("a boolean tensor is added to the scores")
    if isinstance(v, Aff):
        if v.coefs:
            raise Keep("an index-dependent bias is added to the scores (ALiBi/relative position)")
        if v.c == 0:
            return TRUE
        raise Keep(f"a constant {v.c} is added to the scores")
    if v.a == 0 and _fill_ok(v.b):
        return v.pred
    if v.b == 0 and _fill_ok(v.a):
        return _not(v.pred)
    raise Keep(f"additive mask values ({v.a}, {v.b}) are not (0, -inf or <= {_NEG_BIG:g})")


def _fill_finite(v) -> bool:
    """Whether an additive mask's hidden entries are a finite value (see _additive_allowed) rather than -inf."""
    s = _as_sel(v)
    hidden = s.b if s.a == 0 else s.a
    return isinstance(hidden, (int, float)) and math.isfinite(hidden)
