"""The values the mask prover (patterns/_mask.py) computes with: functions of a tensor's element index.

An `Aff` is affine in the index (Σ k·index[axis] plus a constant), a `Pred` an intersection of half-planes
Σ k·index[axis] + c >= 0 (or the empty set) and of run-time literals (HF's padding `attention_mask[batch, key]`, its
packed-sequence ids compared at the query and the key), a `Sel` a choice between two constants by a `Pred`, a
`Gather` a run-time tensor read at affine indices (only compared for equality). Axes are
negative (-1 = last), so broadcasting aligns them for free; coefficients on axes of size 1 are dropped (their index
is always 0). Anything outside this algebra raises `Keep`.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import sympy

from ._fx import Keep, eq


Coefs = tuple  # sorted ((axis, k), ...) with k != 0


def _coefs(d: dict) -> Coefs:
    return tuple(sorted((a, k) for a, k in d.items() if k != 0))


@dataclasses.dataclass(frozen=True)
class Aff:
    """c + Σ k·index[axis] (a constant when there are no coefficients); c is a number or an integer sympy expression
    in symbolic sizes."""

    coefs: Coefs = ()
    c: Any = 0


@dataclasses.dataclass(frozen=True)
class Pred:
    """Boolean: the intersection of half-planes Σ k·index[axis] + c >= 0 and of run-time literals `pads`; `false` is
    the empty set. A literal ("keep", node, row, col) is true where the run-time 2-D bool tensor `node` holds True at
    [row, col]; ("same", node, row, col, col2) where `node` holds equal values at [row, col] and [row, col2]; each
    index an affine form (coefs, c)."""

    planes: frozenset = frozenset()
    false: bool = False
    pads: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class Gather:
    """A run-time 2-D tensor `node` read at [row, col] (affine forms); only compared for equality."""

    node: Any
    row: tuple
    col: tuple


@dataclasses.dataclass(frozen=True)
class Sel:
    """where(pred, a, b) with constant a, b."""

    pred: Pred
    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class Abs:
    """|arg| of an affine form: only compared (|a| <= c is a <= c and -a <= c: a two-sided band)."""

    arg: Aff


@dataclasses.dataclass(frozen=True)
class FloorDiv:
    """arg // by (a positive int) of an affine form: only compared for equality with another, as chunked attention's
    masks compare chunk ids (i // C == j // C: the literal ("block", C, i's form, j's form), which the mask's box
    decides)."""

    arg: Aff
    by: int


@dataclasses.dataclass(frozen=True)
class Neg:
    """The complement of a Pred that is no Pred itself (the complement of a band is a union): negated again, or what
    masked_fill and where hide or select against."""

    pred: Pred


TRUE, FALSE = Pred(), Pred(false=True)


def _is_int(x) -> bool:
    """An integer constant: a number, or an integer expression in symbolic sizes (a SymInt's sympy expression, such as
    a KV cache's length, which offsets the query positions of a decode step)."""
    if isinstance(x, sympy.Expr):
        return bool(x.is_integer)
    return isinstance(x, (bool, int)) or (isinstance(x, float) and x.is_integer())


def _const(c):
    """An integer constant as an int where it is a number, else its sympy expression."""
    if isinstance(c, sympy.Expr):
        return int(c) if c.is_number else c
    return int(c)


def nonnegative(c) -> bool | None:
    """Whether the integer constant c is >= 0: decided for numbers, and for symbolic expressions whose sign the
    symbols' assumptions (sizes are positive integers) fix; None when undecided."""
    c = _const(c)
    return c >= 0 if isinstance(c, int) else c.is_nonnegative


def _plane(coefs: dict, c) -> Pred:
    """Normalised half-plane Σ k·x + c >= 0 over integers."""
    coefs = {a: k for a, k in coefs.items() if k != 0}
    if not all(_is_int(k) for k in coefs.values()) or not _is_int(c):
        raise Keep("mask compares non-integer index expressions")
    coefs = {a: int(k) for a, k in coefs.items()}
    c = _const(c)
    if not coefs:
        holds = nonnegative(c)
        if holds is None:
            raise Keep(f"the mask depends on the sign of the symbolic value `{c}`")
        return TRUE if holds else FALSE
    g = math.gcd(*[abs(k) for k in coefs.values()])
    if g != 1 and not isinstance(c, int):
        raise Keep(f"mask scales the symbolic offset `{c}`")
    return Pred(frozenset({(_coefs({a: k // g for a, k in coefs.items()}), c // g)}))


def _and(p: Pred, q: Pred) -> Pred:
    if p.false or q.false:
        return FALSE
    return Pred(p.planes | q.planes, pads=p.pads | q.pads)


def _not(p: Pred) -> Pred:
    if p.pads:
        raise Keep("mask negates a padding mask")
    if p.false:
        return TRUE
    if not p.planes:
        return FALSE
    if len(p.planes) == 1:
        (coefs, c), = p.planes
        return _plane({a: -k for a, k in coefs}, -c - 1)
    raise Keep("mask negates an intersection (a union of regions)")


def complement(p: Pred) -> Pred | Neg:
    """not p: a Pred where one is, else Neg(p) (a union of half-planes)."""
    if len(p.planes) > 1 and not p.pads and not p.false:
        return Neg(p)
    return _not(p)


def _or(p: Pred, q: Pred) -> Pred:
    if p.pads or q.pads:
        if p == q or q.false:
            return p
        if p.false:
            return q
        raise Keep("mask is a union with a padding mask")
    if p.false or not q.planes and not q.false:
        return q if p.false else TRUE
    if q.false or not p.planes:
        return p if q.false else TRUE
    if p == q:
        return p
    raise Keep("mask is a union of regions")


def _as_pred(v) -> Pred:
    if isinstance(v, Pred):
        return v
    if isinstance(v, Neg):
        raise Keep("mask is a union of regions (what a band hides)")
    if isinstance(v, Aff) and not v.coefs:
        return TRUE if v.c else FALSE
    if isinstance(v, Sel):
        a, b = bool(v.a), bool(v.b)
        return TRUE if a and b else FALSE if not a and not b else v.pred if a else _not(v.pred)
    raise Keep("mask converts an index expression to bool")


def _as_sel(v) -> Sel:
    if isinstance(v, Sel):
        return v
    if isinstance(v, Pred):
        return Sel(v, 1, 0)
    if isinstance(v, Aff) and not v.coefs:
        return Sel(TRUE, v.c, v.c)
    raise Keep("mask mixes index expressions with selections")


def _simplify(v):
    if isinstance(v, Sel):
        if v.pred == TRUE or v.a == v.b:
            return Aff((), v.a)
        if v.pred.false:
            return Aff((), v.b)
    return v


def _shift(v, fn):
    """Rewrite every linear form (coefs, c) of a value with fn(coefs_dict, c) -> (coefs_dict, c) (a run offset, see
    `run_axis`, or a left-padding count is no axis of the index and stays as it is)."""
    if isinstance(v, Aff):
        coefs, c = fn({a: k for a, k in v.coefs if a < 0}, v.c)
        return Aff(_coefs({**coefs, **{a: k for a, k in v.coefs if a > 0}}), c)
    if isinstance(v, Pred):
        if v.false or not (v.planes or v.pads):
            return v
        out = TRUE
        for coefs, c in v.planes:
            out = _and(out, _plane(*fn(dict(coefs), c)))
        if out.false:
            return out

        return Pred(out.planes, pads=frozenset((lit[0], lit[1], *(_form(fn, f) for f in lit[2:])) for lit in v.pads))
    if isinstance(v, Gather):
        return Gather(v.node, _form(fn, v.row), _form(fn, v.col))
    if isinstance(v, Abs):
        return Abs(_shift(v.arg, fn))
    if isinstance(v, FloorDiv):
        return FloorDiv(_shift(v.arg, fn), v.by)
    if isinstance(v, Neg):
        return Neg(_shift(v.pred, fn))
    if isinstance(v, Sel):
        return _simplify(Sel(_shift(v.pred, fn), v.a, v.b))
    raise TypeError(v)


def _form(fn, f):
    coefs, c = fn({a: k for a, k in f[0] if a < 0}, f[1])
    return _coefs({**coefs, **{a: k for a, k in f[0] if a > 0}}), c


def _drop_unit_axes(v, shape):
    """Forget coefficients on size-1 axes (and reject any beyond the rank)."""
    nd = len(shape)

    def fn(coefs, c):
        out = {}
        for a, k in coefs.items():
            if a < -nd:
                raise Keep("mask index analysis lost track of an axis")
            if not eq(shape[a], 1):
                out[a] = k
        return out, c

    return _shift(v, fn)


def _remap(v, mapping: dict[int, int]):
    """Move coefficients from old axes to new axes; an axis not in `mapping` must have none."""

    def fn(coefs, c):
        out = {}
        for a, k in coefs.items():
            if a not in mapping:
                raise Keep("mask reshape mixes index dimensions")
            out[mapping[a]] = out.get(mapping[a], 0) + k
        return out, c

    return _shift(v, fn)


def _linear(op: str, x, y):
    """x op y for Aff/Sel/Pred values (add, sub, mul, div)."""
    if isinstance(x, Aff) and isinstance(y, Aff):
        if op in ("add", "sub"):
            s = 1 if op == "add" else -1
            coefs = dict(x.coefs)
            for a, k in y.coefs:
                coefs[a] = coefs.get(a, 0) + s * k
            return Aff(_coefs(coefs), x.c + s * y.c)
        if op == "mul" and (not x.coefs or not y.coefs):
            const, lin = (x, y) if not x.coefs else (y, x)
            return Aff(_coefs({a: k * const.c for a, k in lin.coefs}), lin.c * const.c)
        if op == "div" and not y.coefs and not x.coefs and y.c != 0:
            return Aff((), x.c / y.c)
        raise Keep(f"mask uses a non-affine {op} of indices")
    sx, sy = _as_sel(x), _as_sel(y)
    f = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}[op]
    if sx.pred == sy.pred:
        return _simplify(Sel(sx.pred, f(sx.a, sy.a), f(sx.b, sy.b)))
    if sy.pred == TRUE or sy.a == sy.b:
        return _simplify(Sel(sx.pred, f(sx.a, sy.a), f(sx.b, sy.a)))
    if sx.pred == TRUE or sx.a == sx.b:
        return _simplify(Sel(sy.pred, f(sx.a, sy.a), f(sx.a, sy.b)))
    raise Keep(f"mask combines two different regions with {op}")


def run_axis(node) -> int:
    """The pseudo-axis of run-time position ids `node` (positive; the index's axes are negative): a read
    pos[b, x] is the Aff x + R, R an unknown offset per packed sequence, which cancels between two reads in one
    sequence. A comparison where it cancels carries the literal ("runs", axis): the mask analysis then requires the
    same-sequence literal of the ids made from these positions (patterns/_mask.py)."""
    return id(node)


_FLIPPED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}


def _compare(op: str, x, y) -> Pred:
    if isinstance(x, FloorDiv) or isinstance(y, FloorDiv):
        if not (isinstance(x, FloorDiv) and isinstance(y, FloorDiv) and x.by == y.by and op == "eq"):
            raise Keep("mask compares a floor division other than two chunk ids for equality")
        forms = [(a.coefs, a.c) for a in (x.arg, y.arg)]
        return Pred(pads=frozenset({("block", x.by, *forms)}))
    if isinstance(x, Abs) or isinstance(y, Abs):
        if not isinstance(x, Abs):
            x, y, op = y, x, _FLIPPED[op]
        if not isinstance(y, Aff) or op in ("eq", "ne"):
            raise Keep(f"mask compares an absolute value by {op} or with another absolute value")
        if op in ("ge", "gt"):  # |a| >= y is not |a| < y
            return complement(_compare("lt" if op == "ge" else "le", x, y))
        return _and(_compare(op, x.arg, y), _compare(op, _linear("mul", x.arg, Aff((), -1)), y))
    if isinstance(x, Gather) or isinstance(y, Gather):
        if op == "eq" and isinstance(x, Gather) and isinstance(y, Gather) and x.node is y.node and x.row == y.row:
            return Pred(pads=frozenset({("same", x.node, x.row, *sorted((x.col, y.col)))}))
        raise Keep("mask compares a run-time tensor other than by equality of two reads of one row")
    if isinstance(x, Aff) and isinstance(y, Aff):
        d = _linear("sub", x, y)  # x - y
        if any(a > 0 for a, _ in d.coefs):
            raise Keep("mask compares run-time position ids other than two reads in one packed sequence")
        runs = {a for a, _ in x.coefs + y.coefs if a > 0}
        if runs:
            return _and(_compare(op, Aff(d.coefs, d.c), Aff()), Pred(pads=frozenset(("runs", a) for a in runs)))
        coefs = dict(d.coefs)
        neg = {a: -k for a, k in coefs.items()}
        if op == "ge":
            return _plane(coefs, d.c)
        if op == "gt":
            return _plane(coefs, d.c - 1)
        if op == "le":
            return _plane(neg, -d.c)
        if op == "lt":
            return _plane(neg, -d.c - 1)
        eq = _and(_plane(coefs, d.c), _plane(neg, -d.c))
        return eq if op == "eq" else _not(eq)
    if op in ("eq", "ne"):  # a two-valued mask compared with a constant, e.g. `tril(ones) == 0`
        if isinstance(x, Aff) and not x.coefs:
            x, y = y, x
        if isinstance(y, Aff) and not y.coefs:
            s = _as_sel(x)
            a, b = (s.a == y.c), (s.b == y.c)
            if op == "ne":
                a, b = not a, not b
            return _as_pred(Sel(s.pred, a, b))
    raise Keep(f"mask uses an unsupported comparison ({op})")
