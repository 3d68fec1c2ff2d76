"""Matcher for softmax attention on the Dynamo (torch-IR) graph -> `tk::attention`.

Two sources, one op:

* `F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)`:
  no mask, `is_causal=True`, or an `attn_mask` proven causal/all-visible by the mask analysis below;
  `dropout_p == 0` (SDPA drops even in eval); default scale 1/sqrt(D) or the given one; GQA by
  `enable_gqa` or a `repeat_kv` in front of it.
* eager attention, `matmul -> scale -> mask -> softmax -> dropout -> matmul`:
  - the products as `torch.matmul`, `@`, `Tensor.matmul`, `torch.bmm` on (B*H, N, D) views of
    (B, H, N, D) tensors (also scores made in 3-D then viewed to 4-D), `torch.baddbmm(_, q, kᵀ,
    beta=0, alpha=scale)` (GPT-2's reorder_and_upcast_attn), or `einsum("...nd,...md->...nm")` /
    `einsum("...nm,...md->...nd")`;
    k transposed by `transpose(-1, -2)` / `transpose(2, 3)` / `permute` / `.mT`;
  - scaling by `mul` or `div` with a positive constant, on q, on k, or on the scores, before or
    after the mask (several factors multiply);
  - softmax over the last dim as `torch.softmax`, `F.softmax`, `Tensor.softmax`, with
    `dtype=torch.float32` or with a `.float()`/`.to(torch.float32)` upcast and a cast back
    (`.to(q.dtype)`, `.type(v.dtype)`, `.type_as(q)`...);
  - causal masks applied by `masked_fill(masked, v)`, `torch.where(allowed, s, v)` or additive
    `s + mask`, with v = -inf or a finite value <= finfo(float16).min (finfo(dtype).min of every
    float dtype): after the max-subtracting softmax those give exactly zero probability, as -inf
    does, unless genuine scores are themselves below about -6.5e4; `-1e4` and friends are kept;
  - `F.dropout` / `torch.dropout` with p == 0 or training=False;
  - `repeat_kv` (`x[:, :, None].expand(...).reshape(...)`, `unsqueeze(2).expand(...).reshape/flatten`)
    and `repeat_interleave(x, r, dim=1)` are dropped: the op does GQA natively; HF's empty-cache
    `torch.cat([tensor([]), k], dim=-2)` is seen through.

Masks are *proven*, not guessed: `_MaskEval` interprets the subgraph that builds a mask symbolically,
as affine functions of the element index (arange + offsets, broadcasting views, advanced indexing,
diff/cumsum of constant steps), predicates that are intersections of half-planes in (query i, key j),
and two-valued selections. It covers tril/triu of ones/full, arange comparisons, `where`,
`masked_fill`, and transformers 5.x's `sdpa_mask`/`eager_mask` including the packed-sequence
detection on in-graph position ids. A mask is causal iff its allowed set is exactly {j <= i}
(top-left, as the op), all-visible iff it allows everything. A mask built in the graph from a graph
input (a padding mask, user position_ids, a mask buffer) or with any op outside this vocabulary is kept
with the reason.

A mask that *is* a graph input (up to views and casts) — what every layer sees after DDP's graph
splitting, FSDP2's graph breaks or a per-layer `torch.compile`, where the mask was built in another
graph — goes to `tk::attention_masked` (SDPA masks, and additive masks in eager attention when nothing
scales the scores after the mask): the op checks its values once per mask tensor at run time and runs the
kernel when it is causal or all-visible, SDPA with the mask otherwise. The graph that made such a mask proves
it here too (`output_mask_kinds`), and the backend records the proof on the output tensor at run time, so the
op need not read the values (which waits for the GPU once per step).

What Dynamo sees of transformers 5.x masks (masking_utils): without a padding mask the mask is built
inside the graph from `arange`s — `sdpa_mask` returns None (SDPA gets is_causal=True) unless
position ids are known, in which case (training, no cache) it materialises `kv_idx <= q_idx` combined
with the packed-sequence check `diff(position_ids) != 1 ... cumsum` on the in-graph position ids;
`eager_mask` turns the same boolean mask into `where(mask, 0, finfo.min)`. All of these are proven
here. A user `attention_mask` (padding) or user `position_ids` (possibly packed sequences) are graph
inputs: kept. A decode step against a cache (q offset = cache length) gives an all-visible mask for
one query and is replaced as non-causal attention; offsets that leave a diagonal are kept.

Kept (recognised, not replaced), each with its reason in the report: padding or arbitrary masks,
sliding windows, diagonal-offset causal masks, additive biases (ALiBi, relative position),
softcapping (tanh) or any other op between the products, dropout p > 0 in training, SDPA
dropout_p > 0, attention weights used elsewhere (output_attentions), value head dim != q/k head dim,
Hq % Hkv != 0, batch broadcasting, and (kernel mode on CUDA) dtypes other than bf16/fp16 or head
dims other than 64/128.

Dtype/head-dim policy in reference mode: those two limits belong to the CUDA kernels, not to the
op (whose reference accepts any float dtype and head dim). So they are checked only when a kernel
would run: inputs on CUDA and reference mode off in the compile's resolved config (`find(graph, cfg)`:
TK_INDUCTOR_REFERENCE, `tk_inductor.config.patch(reference=True)` or `options={"reference": True}`). On
other devices the op only ever runs its reference, so reference-mode CPU tests in fp32 are replaced, and
without reference mode the shared check keeps them for their device.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from tk_inductor import config
from tk_inductor.ops import attention as attention_ops
from tk_inductor.rewrite import Cast, Match, example

from ._fx import arg as _arg

FAMILY = "attention"
log = logging.getLogger("tk_inductor")
_NEG_BIG = torch.finfo(torch.float16).min  # fill values at or below this vanish in softmax


class _Keep(Exception):
    """The subgraph is attention but cannot be replaced; the message is the reason."""


# ---------------------------------------------------------------------------- node vocabulary

_FN: dict[Any, str] = {
        operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub",
        operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
        torch.true_divide: "div", operator.neg: "neg", torch.neg: "neg",
        operator.le: "le", torch.le: "le", operator.lt: "lt", torch.lt: "lt",
        operator.ge: "ge", torch.ge: "ge", operator.gt: "gt", torch.gt: "gt",
        operator.eq: "eq", torch.eq: "eq", operator.ne: "ne", torch.ne: "ne",
        torch.greater_equal: "ge", torch.greater: "gt", torch.less_equal: "le", torch.less: "lt",
        operator.and_: "and", torch.logical_and: "and", torch.bitwise_and: "and",
        operator.or_: "or", torch.logical_or: "or", torch.bitwise_or: "or",
        operator.invert: "not", torch.logical_not: "not", torch.bitwise_not: "not",
        torch.where: "where", torch.masked_fill: "masked_fill", torch.tril: "tril", torch.triu: "triu",
        torch.arange: "arange", torch.ones: "ones", torch.zeros: "zeros", torch.full: "full",
        torch.ones_like: "ones_like", torch.zeros_like: "zeros_like", torch.full_like: "full_like",
        torch.tensor: "tensor", torch.scalar_tensor: "tensor", operator.getitem: "getitem",
        torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze", torch.reshape: "reshape",
        torch.transpose: "transpose", torch.permute: "permute", torch.flatten: "flatten",
        torch.diff: "diff", torch.cumsum: "cumsum", torch.broadcast_to: "expand",
        torch.matmul: "matmul", operator.matmul: "matmul", torch.bmm: "bmm", torch.einsum: "einsum",
        torch.baddbmm: "baddbmm",
        torch.softmax: "softmax", F.softmax: "softmax", torch.dropout: "dropout", F.dropout: "dropout",
        F.scaled_dot_product_attention: "sdpa", torch.tanh: "tanh", torch.cat: "cat", torch.clone: "clone",
        torch.repeat_interleave: "repeat_interleave", torch.ops.aten.mT: "mT",
}
_METHOD_ALIASES = {"__and__": "and", "logical_and": "and", "__or__": "or", "logical_or": "or",
                   "logical_not": "not", "__invert__": "not", "bitwise_not": "not", "truediv": "div",
                   "true_divide": "div", "divide": "div", "multiply": "mul", "broadcast_to": "expand",
                   "expand_as": "expand", "greater_equal": "ge", "less_equal": "le", "greater": "gt", "less": "lt",
                   # operators on tensors recorded as method calls (e.g. `a == b` in transformers 5.17's packed-sequence mask)
                   "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
                   "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div", "__neg__": "neg"}
_CASTS = {"to", "type", "type_as", "float", "half", "bfloat16", "double", "bool", "long", "int"}


def _name(node) -> str | None:
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        return _FN.get(node.target)
    if node.op == "call_method":
        return _METHOD_ALIASES.get(node.target, node.target)
    return None


def _shape(x) -> tuple:
    ex = example(x)
    return tuple(ex.shape) if isinstance(ex, torch.Tensor) else ()


def _known(cond) -> bool:
    """True only if `cond` holds for every value of the symbols (no guard is added)."""
    if isinstance(cond, bool):
        return cond
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(cond))
    except Exception:  # noqa: BLE001 - unknown means "not provable"
        return False


def _same(a, b) -> bool:
    return a is b or _known(a == b)


def _is_one(size) -> bool:
    return _same(size, 1)


def _number(x):
    """A python number for constants (ints, floats, bools, SymInts with a fixed value); else None."""
    if isinstance(x, fx.Node):
        x = example(x)
    if isinstance(x, bool):
        return x
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        try:
            expr = x.node.expr
            if expr.is_number:
                return int(expr) if isinstance(x, torch.SymInt) else float(expr)
        except Exception:  # noqa: BLE001
            return None
    return None


# ---------------------------------------------------------------------------- symbolic mask values
# Every value is a function of the element index; axes are negative (-1 = last), so broadcasting
# aligns them for free. Coefficients on axes of size 1 are dropped (their index is always 0).

Coefs = tuple  # sorted ((axis, k), ...) with k != 0


def _coefs(d: dict) -> Coefs:
    return tuple(sorted((a, k) for a, k in d.items() if k != 0))


@dataclasses.dataclass(frozen=True)
class Aff:
    """c + Σ k·index[axis] (a constant when there are no coefficients)."""

    coefs: Coefs = ()
    c: Any = 0


@dataclasses.dataclass(frozen=True)
class Pred:
    """Boolean: the intersection of half-planes Σ k·index[axis] + c >= 0; `false` is the empty set."""

    planes: frozenset = frozenset()
    false: bool = False


@dataclasses.dataclass(frozen=True)
class Sel:
    """where(pred, a, b) with constant a, b."""

    pred: Pred
    a: Any
    b: Any


TRUE, FALSE = Pred(), Pred(false=True)


def _is_int(x) -> bool:
    return isinstance(x, (bool, int)) or (isinstance(x, float) and x.is_integer())


def _plane(coefs: dict, c) -> Pred:
    """Normalised half-plane Σ k·x + c >= 0 over integers."""
    coefs = {a: k for a, k in coefs.items() if k != 0}
    if not all(_is_int(k) for k in coefs.values()) or not _is_int(c):
        raise _Keep("mask compares non-integer index expressions")
    coefs = {a: int(k) for a, k in coefs.items()}
    c = int(c)
    if not coefs:
        return TRUE if c >= 0 else FALSE
    g = math.gcd(*[abs(k) for k in coefs.values()])
    return Pred(frozenset({(_coefs({a: k // g for a, k in coefs.items()}), c // g)}))


def _and(p: Pred, q: Pred) -> Pred:
    if p.false or q.false:
        return FALSE
    return Pred(p.planes | q.planes)


def _not(p: Pred) -> Pred:
    if p.false:
        return TRUE
    if not p.planes:
        return FALSE
    if len(p.planes) == 1:
        (coefs, c), = p.planes
        return _plane({a: -k for a, k in coefs}, -c - 1)
    raise _Keep("mask negates an intersection (a union of regions)")


def _or(p: Pred, q: Pred) -> Pred:
    if p.false or not q.planes and not q.false:
        return q if p.false else TRUE
    if q.false or not p.planes:
        return p if q.false else TRUE
    if p == q:
        return p
    raise _Keep("mask is a union of regions")


def _as_pred(v) -> Pred:
    if isinstance(v, Pred):
        return v
    if isinstance(v, Aff) and not v.coefs:
        return TRUE if v.c else FALSE
    if isinstance(v, Sel):
        a, b = bool(v.a), bool(v.b)
        return TRUE if a and b else FALSE if not a and not b else v.pred if a else _not(v.pred)
    raise _Keep("mask converts an index expression to bool")


def _as_sel(v) -> Sel:
    if isinstance(v, Sel):
        return v
    if isinstance(v, Pred):
        return Sel(v, 1, 0)
    if isinstance(v, Aff) and not v.coefs:
        return Sel(TRUE, v.c, v.c)
    raise _Keep("mask mixes index expressions with selections")


def _simplify(v):
    if isinstance(v, Sel):
        if v.pred == TRUE or v.a == v.b:
            return Aff((), v.a)
        if v.pred.false:
            return Aff((), v.b)
    return v


def _shift(v, fn):
    """Rewrite every linear form (coefs, c) of a value with fn(coefs_dict, c) -> (coefs_dict, c)."""
    if isinstance(v, Aff):
        coefs, c = fn(dict(v.coefs), v.c)
        return Aff(_coefs(coefs), c)
    if isinstance(v, Pred):
        if v.false or not v.planes:
            return v
        out = TRUE
        for coefs, c in v.planes:
            out = _and(out, _plane(*fn(dict(coefs), c)))
        return out
    if isinstance(v, Sel):
        return _simplify(Sel(_shift(v.pred, fn), v.a, v.b))
    raise TypeError(v)


def _drop_unit_axes(v, shape):
    """Forget coefficients on size-1 axes (and reject any beyond the rank)."""
    nd = len(shape)

    def fn(coefs, c):
        out = {}
        for a, k in coefs.items():
            if a < -nd:
                raise _Keep("mask index analysis lost track of an axis")
            if not _is_one(shape[a]):
                out[a] = k
        return out, c

    return _shift(v, fn)


def _remap(v, mapping: dict[int, int]):
    """Move coefficients from old axes to new axes; an axis not in `mapping` must have none."""

    def fn(coefs, c):
        out = {}
        for a, k in coefs.items():
            if a not in mapping:
                raise _Keep("mask reshape mixes index dimensions")
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
        raise _Keep(f"mask uses a non-affine {op} of indices")
    sx, sy = _as_sel(x), _as_sel(y)
    f = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}[op]
    if sx.pred == sy.pred:
        return _simplify(Sel(sx.pred, f(sx.a, sy.a), f(sx.b, sy.b)))
    if sy.pred == TRUE or sy.a == sy.b:
        return _simplify(Sel(sx.pred, f(sx.a, sy.a), f(sx.b, sy.a)))
    if sx.pred == TRUE or sx.a == sx.b:
        return _simplify(Sel(sy.pred, f(sx.a, sy.a), f(sx.a, sy.b)))
    raise _Keep(f"mask combines two different regions with {op}")


def _compare(op: str, x, y) -> Pred:
    if isinstance(x, Aff) and isinstance(y, Aff):
        d = _linear("sub", x, y)  # x - y
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
    raise _Keep(f"mask uses an unsupported comparison ({op})")


class _MaskEval:
    """Symbolic values of the nodes that build a mask (memoised per graph)."""

    def __init__(self):
        self.memo: dict[fx.Node, Any] = {}

    def __call__(self, x):
        if not isinstance(x, fx.Node):
            n = _number(x)
            if n is None:
                raise _Keep(f"mask uses a non-constant {type(x).__name__}")
            return Aff((), n)
        if x not in self.memo:
            try:
                v = self._eval(x)
            except _Keep as e:
                v = e
            self.memo[x] = v
        v = self.memo[x]
        if isinstance(v, _Keep):
            raise v
        return v

    def _eval(self, node: fx.Node):
        n = _number(node)
        if n is not None and not isinstance(example(node), torch.Tensor):
            return Aff((), n)  # a SymInt/SymFloat with a fixed value
        if isinstance(example(node), (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _Keep(f"it depends on the symbolic value `{node.name}`")
        if node.op == "placeholder":
            raise _Keep(f"it is built from graph input `{node.target}` (a padding/custom mask or "
                        "position ids whose values are unknown at compile time)")
        if node.op == "get_attr":
            raise _Keep(f"it is a constant tensor `{node.target}` whose structure is not analysed")
        name = _name(node)
        handler = getattr(self, f"_op_{name}", None) if name else None
        if handler is None:
            what = name or (node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target))
            raise _Keep(f"it uses `{what}`, which the mask analysis does not model")
        v = handler(node)
        shape = _shape(node)
        v = _drop_unit_axes(v, shape)
        if isinstance(example(node), torch.Tensor):
            dtype = example(node).dtype
            if dtype == torch.bool and not isinstance(v, Pred):
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
        start, step = _number(start), _number(step)
        if start is None or step is None or isinstance(start, bool):
            raise _Keep("mask uses arange with a symbolic start/step")
        return Aff(_coefs({-1: step}), start)

    def _const(self, fill):
        v = _number(fill)
        if v is None:
            raise _Keep("mask fill value is not a constant")
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
            raise _Keep("mask uses add with alpha")
        return _linear("add", self(node.args[0]), self(node.args[1]))

    def _op_sub(self, node):
        if node.kwargs.get("alpha", 1) != 1:
            raise _Keep("mask uses sub with alpha")
        return _linear("sub", self(node.args[0]), self(node.args[1]))

    def _op_mul(self, node):
        x, y = self(node.args[0]), self(node.args[1])
        if isinstance(x, Pred) and isinstance(y, Pred):
            return _and(x, y)
        return _linear("mul", x, y)

    def _op_div(self, node):
        if node.kwargs.get("rounding_mode") is not None:
            raise _Keep("mask uses a rounding division")
        return _linear("div", self(node.args[0]), self(node.args[1]))

    def _op_neg(self, node):
        return _linear("mul", self(node.args[0]), Aff((), -1))

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
        return _not(_as_pred(self(node.args[0])))

    def _op_where(self, node):
        if len(node.args) + len(node.kwargs) < 3:
            raise _Keep("mask uses one-argument where")
        cond = _as_pred(self(_arg(node, 0, "condition")))
        a, b = self(_arg(node, 1, "input")), self(_arg(node, 2, "other"))
        if isinstance(a, Aff) and isinstance(b, Aff) and not a.coefs and not b.coefs:
            return _simplify(Sel(cond, a.c, b.c))
        if isinstance(a, Pred) and isinstance(b, Aff) and not b.coefs and not b.c:
            return _and(cond, a)
        raise _Keep("mask selects between non-constant values")

    def _op_masked_fill(self, node):
        x = self(node.args[0])
        p = _as_pred(self(_arg(node, 1, "mask")))
        v = self(_arg(node, 2, "value"))
        if not (isinstance(v, Aff) and not v.coefs):
            raise _Keep("mask fill value is not a constant")
        if isinstance(x, Aff) and not x.coefs:
            return _simplify(Sel(p, v.c, x.c))
        if isinstance(x, Pred) and not v.c:  # a bool mask with more positions cleared
            return _and(x, _not(p))
        raise _Keep("mask fills a non-constant tensor")

    def _tri(self, node, lower: bool):
        x = self(node.args[0])
        d = _number(_arg(node, 1, "diagonal", 0))
        if d is None:
            raise _Keep("tril/triu with a symbolic diagonal")
        # tril keeps key j <= query i + d  (i - j + d >= 0); triu keeps j >= i + d  (j - i - d >= 0)
        keep = _plane({-2: 1, -1: -1}, d) if lower else _plane({-2: -1, -1: 1}, -d)
        if isinstance(x, Pred):
            return _and(x, keep)
        s = _as_sel(x)
        if s.b != 0 and s.pred != TRUE and s.a != s.b:
            raise _Keep("tril/triu of a non-constant mask")
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
        ins, outs = _shape(src), _shape(node)
        big_in = [i for i, s in enumerate(ins) if not _is_one(s)]
        big_out = [i for i, s in enumerate(outs) if not _is_one(s)]
        if len(big_in) != len(big_out) or not all(_same(ins[a], outs[b]) for a, b in zip(big_in, big_out)):
            raise _Keep("mask reshape merges or splits dimensions")
        return _remap(v, {a - len(ins): b - len(outs) for a, b in zip(big_in, big_out)})

    _op_view = _op_reshape = _op_unsqueeze = _op_squeeze = _op_flatten = _by_unit_dims

    def _op_transpose(self, node):
        nd = len(_shape(node))
        a, b = (int(x) % nd - nd for x in node.args[1:3])
        return _remap(self(node.args[0]), {a: b, b: a, **{x: x for x in range(-nd, 0) if x not in (a, b)}})

    def _op_permute(self, node):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        nd = len(dims)
        return _remap(self(node.args[0]), {int(d) % nd - nd: i - nd for i, d in enumerate(dims)})

    def _op_getitem(self, node):
        src, index = node.args
        if isinstance(example(src), (list, tuple)):
            raise _Keep("mask indexes a tuple")
        index = index if isinstance(index, tuple) else (index,)
        v = self(src)
        ins, outs = _shape(src), _shape(node)
        if index and all(isinstance(i, fx.Node) and isinstance(example(i), torch.Tensor) for i in index):
            return self._advanced(v, ins, outs, index)
        if any(isinstance(i, fx.Node) and isinstance(example(i), torch.Tensor) for i in index):
            raise _Keep("mask mixes advanced and basic indexing")
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
                start = 0 if i.start is None else _number(i.start)
                step = 1 if i.step is None else _number(i.step)
                if start is None or step is None or start < 0:
                    raise _Keep("mask slices from a symbolic or negative start")
                mapping[d_in - len(ins)] = d_out - len(outs)
                shift[d_in - len(ins)] = (start, step)
                d_out += 1
            else:
                idx = _number(i)
                if idx is None or isinstance(idx, bool) or idx < 0:
                    raise _Keep("mask indexes with a symbolic or negative integer")
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

    def _advanced(self, v, ins, outs, index):
        """x[i0, i1, ...] with integer index tensors for every dim: substitute the indices' values."""
        if len(index) != len(ins):
            raise _Keep("mask uses partial advanced indexing")
        subs = {}
        for pos, i in enumerate(index):
            iv = self(i)
            if not isinstance(iv, Aff) or not all(_is_int(k) for _, k in iv.coefs) or not _is_int(iv.c):
                raise _Keep("mask indexes with non-integer indices")
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
        dim = _number(_arg(node, 2, "dim", -1))
        n = _number(_arg(node, 1, "n", 1))
        prepend, append = node.kwargs.get("prepend"), node.kwargs.get("append")
        nd = len(_shape(node.args[0]))
        if n != 1 or append is not None or dim is None or not isinstance(x, Aff):
            raise _Keep("mask uses a diff it cannot model")
        ax = dim % nd - nd
        coefs = dict(x.coefs)
        step = coefs.pop(ax, 0)
        if prepend is not None:
            # first element: x[..., 0] - prepend must equal the interior step
            first = _linear("sub", Aff(_coefs(coefs), x.c), self(prepend))
            if first.coefs or first.c != step:
                raise _Keep("mask uses a diff whose first element differs")
        return Aff((), step)

    def _op_cumsum(self, node):
        x = self(node.args[0])
        if isinstance(x, Pred):
            x = _as_sel(x)
            if x.pred not in (TRUE, FALSE) and x.a != x.b:
                raise _Keep("mask uses a cumsum of a non-constant")
            x = Aff((), int(x.a) if x.pred != FALSE else int(x.b))
        if not isinstance(x, Aff) or x.coefs:
            raise _Keep("mask uses a cumsum of a non-constant")
        nd = len(_shape(node))
        ax = _number(_arg(node, 1, "dim")) % nd - nd
        return Aff(_coefs({ax: x.c}), x.c)  # running sum of a constant c: c·(index + 1)


# ---------------------------------------------------------------------------- mask -> causal?

_CAUSAL = frozenset({(_coefs({-2: 1, -1: -1}), 0)})  # key j <= query i


def _on_box(planes, sizes: dict) -> set | None:
    """The half-planes that still cut the (query, key) box [0, N) x [0, M); None if one is empty there.

    Coefficients on axes of size 1 vanish (their index is 0), planes that hold on the whole box
    (their minimum over it is >= 0, needs static sizes for negative coefficients) are dropped, and
    what remains is renormalised, so equal regions of the box compare equal."""
    out = set()
    for coefs, c in planes:
        d = {a: k for a, k in coefs if not _is_one(sizes[a])}
        sz = {a: _number(sizes[a]) for a in d}
        if all(k > 0 or sz[a] is not None for a, k in d.items()):
            low = c + sum(k * (sz[a] - 1) for a, k in d.items() if k < 0)
            high = c + sum(k * (sz[a] - 1) for a, k in d.items() if k > 0) if all(v is not None for v in sz.values()) else None
            if low >= 0:
                continue  # holds everywhere
            if high is not None and high < 0:
                return None  # holds nowhere
        plane = _plane(d, c)
        if plane.false:
            return None
        out |= plane.planes
    return out


def _allowed_kind(allowed: Pred, score_shape: tuple) -> bool:
    """True: causal (top-left); False: every position allowed. Raises _Keep otherwise.

    Decided on the actual box of scores: for one query causal means "key 0 only", for one key it
    means "everything" (reported as non-causal, the cheaper kernel path)."""
    if allowed.false:
        raise _Keep("the mask hides every key")
    for coefs, _ in allowed.planes:
        if {a for a, _ in coefs} - {-1, -2}:
            raise _Keep("the mask varies over batch or heads (padding-like)")
    sizes = {-2: score_shape[-2], -1: score_shape[-1]}
    planes = _on_box(allowed.planes, sizes)
    causal = _on_box(_CAUSAL, sizes)
    if planes is None:
        raise _Keep("the mask hides every key")
    if not planes:
        return False
    if planes == causal:
        return True
    diagonal = _coefs({-2: 1, -1: -1})
    for coefs, c in planes:
        if coefs == diagonal and c != 0 and len(planes) == 1:
            raise _Keep(f"causal mask with a diagonal offset of {c} (not top-left aligned)")
    if (diagonal, 0) in planes and any(co == _coefs({-2: -1, -1: 1}) for co, _ in planes):
        raise _Keep("sliding-window mask")
    raise _Keep("the mask is not a plain causal mask")


def _fill_ok(v) -> bool:
    return isinstance(v, (int, float)) and (v == -math.inf or (math.isfinite(v) and v <= _NEG_BIG))


def _additive_allowed(v) -> Pred:
    """The allowed set of an additive mask (0 where allowed, a vanishing value elsewhere)."""
    if isinstance(v, Pred):
        raise _Keep("a boolean tensor is added to the scores")
    if isinstance(v, Aff):
        if v.coefs:
            raise _Keep("an index-dependent bias is added to the scores (ALiBi/relative position)")
        if v.c == 0:
            return TRUE
        raise _Keep(f"a constant {v.c} is added to the scores")
    if v.a == 0 and _fill_ok(v.b):
        return v.pred
    if v.b == 0 and _fill_ok(v.a):
        return _not(v.pred)
    raise _Keep(f"additive mask values ({v.a}, {v.b}) are not (0, -inf or <= {_NEG_BIG:g})")


def _from_graph_input(node) -> bool:
    """Whether a mask is a graph input, up to views and casts: its values exist only at run time (DDP's graph
    splitting, FSDP's graph breaks, a per-layer compile), so tk::attention_masked checks them there."""
    while isinstance(node, fx.Node) and node.op != "placeholder":
        if node.op not in ("call_function", "call_method") or not node.args:
            return False
        if _name(node) not in _CASTS | {"getitem", "expand", "unsqueeze", "view", "reshape", "contiguous", "clone"}:
            return False
        node = node.args[0]
    return isinstance(node, fx.Node)


# ---------------------------------------------------------------------------- operands

@dataclasses.dataclass
class _Operand:
    node: fx.Node
    transposed: bool = False  # the operand is node.transpose(-1, -2)
    merged: bool = False  # the operand is node.flatten(0, 1) of a 4-D node
    scale: float = 1.0
    repeated: int = 1  # a repeat_kv/repeat_interleave over heads was dropped
    want_t: bool = False  # the product reads this operand transposed (k in `q @ k.transpose(-1, -2)`)
    cast: torch.dtype | None = None  # a cast to this dtype was looked through: the op reads node cast

    def needs_transpose(self) -> bool:
        """Whether the op input is node.transpose(-1, -2) rather than node itself."""
        return self.transposed != self.want_t

    def dtype(self) -> torch.dtype | None:
        """The dtype the attention computes this operand in."""
        ex = example(self.node)
        return self.cast or (ex.dtype if isinstance(ex, torch.Tensor) else None)

    def arg(self):
        """The op's argument: the node, or the node cast (a cast commutes with the views looked through)."""
        ex = example(self.node)
        if self.cast is not None and isinstance(ex, torch.Tensor) and ex.dtype != self.cast:
            return Cast(self.node, self.cast)
        return self.node


def _swaps_last_two(node: fx.Node) -> bool:
    nd = len(_shape(node))
    name = _name(node)
    if name == "mT":
        return True
    if name == "transpose":
        dims = {int(_number(d)) % nd for d in node.args[1:3]} if len(node.args) >= 3 else set()
        return dims == {nd - 2, nd - 1}
    if name == "permute":
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        dims = [int(_number(d)) % nd for d in dims]
        return dims == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def _repeat_kv_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, r) if node is x (B, H, M, D) with every head repeated r times consecutively."""
    name = _name(node)
    if name == "repeat_interleave":
        reps, dim = _number(_arg(node, 1, "repeats")), _arg(node, 2, "dim")
        src = node.args[0]
        if isinstance(reps, int) and dim is not None and len(_shape(src)) == 4 and int(_number(dim)) % 4 == 1:
            return src, reps
        return None
    if name not in ("reshape", "view", "flatten"):
        return None
    exp = node.args[0]
    out = _shape(node)
    if _name(exp) != "expand" or len(_shape(exp)) != 5 or len(out) != 4:
        return None
    B, H, r, M, D = _shape(exp)
    if not (_same(out[0], B) and _same(out[1], H * r) and _same(out[2], M) and _same(out[3], D)):
        return None
    unsq = exp.args[0]
    us = _shape(unsq)
    if len(us) != 5 or not _is_one(us[2]):
        return None
    src = None
    if _name(unsq) == "unsqueeze" and int(_number(_arg(unsq, 1, "dim"))) % 5 == 2:
        src = unsq.args[0]
    elif _name(unsq) == "getitem":
        index = unsq.args[1]
        if (isinstance(index, tuple) and len(index) >= 3 and index[2] is None
                and all(isinstance(i, slice) and i == slice(None) for i in index[:2] + index[3:])):
            src = unsq.args[0]
    if src is None or len(_shape(src)) != 4:
        return None
    return src, _number(r) if isinstance(_number(r), int) else None


def _positive_const(x):
    v = _number(x) if not isinstance(x, fx.Node) or not isinstance(example(x), torch.Tensor) else None
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 else None


def _peel(node: fx.Node, allow_merge: bool, allow_scale: bool) -> _Operand:
    """Walk back through value-preserving views to the tensor the op should read."""
    op = _Operand(node)
    while True:
        n, name = op.node, _name(op.node)
        if not isinstance(example(n), torch.Tensor):
            return op
        src = n.args[0] if n.args else None
        if name in ("contiguous", "clone") and not n.kwargs.get("memory_format"):
            op.node = src
        elif name in _CASTS and isinstance(src, fx.Node) and isinstance(example(src), torch.Tensor) \
                and example(src).dtype == example(n).dtype and example(src).device == example(n).device:
            op.node = src  # a cast to the dtype it already has
        elif op.cast is None and _float_cast(n):
            op.node, op.cast = src, example(n).dtype  # autocast's cast in front of the product (the outermost only)
        elif _swaps_last_two(n):
            op.node, op.transposed = src, not op.transposed
        elif name in ("mul", "div") and allow_scale and len(n.args) == 2:
            a, b = n.args
            c = _positive_const(b)
            if c is not None and isinstance(a, fx.Node):
                op.node, op.scale = a, op.scale * (c if name == "mul" else 1.0 / c)
            elif name == "mul" and _positive_const(a) is not None and isinstance(b, fx.Node):
                op.node, op.scale = b, op.scale * _positive_const(a)
            else:
                return op
        elif name == "cat" and _cat_single(n) is not None:
            op.node = _cat_single(n)
        elif (rk := _repeat_kv_source(n)) is not None and rk[1] is not None:
            op.node, op.repeated = rk[0], op.repeated * rk[1]
        elif name in ("view", "reshape") and allow_merge and not op.merged:
            s_in, s_out = _shape(src), _shape(n)
            if len(s_in) == 4 and len(s_out) == 3 and _same(s_out[0], s_in[0] * s_in[1]) \
                    and _same(s_out[1], s_in[2]) and _same(s_out[2], s_in[3]):
                op.node, op.merged = src, True
            elif len(s_in) == len(s_out) and all(_same(a, b) for a, b in zip(s_in, s_out)):
                op.node = src
            else:
                return op
        else:
            return op


def _float_cast(node: fx.Node) -> bool:
    """node casts a floating tensor to another floating dtype on the same device, keeping its shape."""
    if _name(node) not in _CASTS or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = example(node.args[0]), example(node)
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.is_floating_point()
            and out.is_floating_point() and src.device == out.device and tuple(src.shape) == tuple(out.shape))


def _cat_single(node: fx.Node) -> fx.Node | None:
    """torch.cat([empty..., x, empty...]) == x (HF's DynamicCache on its first call)."""
    tensors = _arg(node, 0, "tensors")
    if not isinstance(tensors, (list, tuple)):
        return None
    nonempty = [t for t in tensors if not (isinstance(t, fx.Node) and isinstance(example(t), torch.Tensor)
                                           and _known(example(t).numel() == 0))]
    if len(nonempty) != 1 or not isinstance(nonempty[0], fx.Node):
        return None
    x = nonempty[0]
    ex, ey = example(x), example(node)
    if not isinstance(ex, torch.Tensor) or ex.dtype != ey.dtype or len(ex.shape) != len(ey.shape) \
            or not all(_same(a, b) for a, b in zip(ex.shape, ey.shape)):
        return None
    return x


# ---------------------------------------------------------------------------- the replacement call

def attention_adapter(q, k, v, causal: bool, scale: float, transposed: tuple, heads: str, contiguous: bool = False):
    """tk::attention for operands that need a layout change first (3-D batches, pre-transposed k...).

    `transposed` says which of q, k, v must be transposed back (last two dims); `heads` is "4d"
    (as is), "merged" (inputs were (B, H, ...) tensors, the output must be (B*H, N, D)) or
    "none" (3-D inputs without heads: a head axis of 1 is added and removed); `contiguous` returns
    a contiguous result, as the eager product was."""
    q, k, v = (t.transpose(-1, -2) if tr else t for t, tr in zip((q, k, v), transposed))
    if heads == "none":
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    o = torch.ops.tk.attention(q, k, v, causal, scale)[0]
    if heads == "none":
        o = o.squeeze(1)
    elif heads == "merged":
        o = o.flatten(0, 1)
    return o.contiguous() if contiguous else o


# ---------------------------------------------------------------------------- matching

_MATMULS = ("matmul", "bmm")


def _einsum_parts(node: fx.Node):
    """(equation without spaces, [operands]) for a two-operand einsum."""
    eq = node.args[0]
    ops = node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = ops[0]
    if not isinstance(eq, str) or len(ops) != 2:
        return None
    return eq.replace(" ", ""), list(ops)


def _einsum_kind(node: fx.Node) -> str | None:
    """"qk" for '...nd,...md->...nm', "pv" for '...nm,...md->...nd' (same batch letters), else None."""
    parts = _einsum_parts(node)
    if parts is None or "->" not in parts[0]:
        return None
    lhs, out = parts[0].split("->")
    ins = lhs.split(",")
    if len(ins) != 2 or any(len(s) < 2 for s in ins + [out]):
        return None
    a, b = ins
    if not (a[:-2] == b[:-2] == out[:-2]) or set(a[:-2].replace(".", "")) & set(a[-2:] + b[-2:]):
        return None
    n, x = a[-2], a[-1]
    if b[-1] == x and len({n, x, b[-2]}) == 3 and out[-2:] == n + b[-2]:
        return "qk"  # ...nd,...md->...nm
    if b[-2] == x and len({n, x, b[-1]}) == 3 and out[-2:] == n + b[-1]:
        return "pv"  # ...nm,...md->...nd
    return None


def _in_place(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _operands(node: fx.Node):
    name = _name(node)
    if name == "baddbmm":
        return _arg(node, 1, "batch1"), _arg(node, 2, "batch2")
    if name in _MATMULS:
        return node.args[0], _arg(node, 1, "other" if name == "matmul" else "mat2")
    parts = _einsum_parts(node)
    return parts[1][0], parts[1][1]


def _is_product(node: fx.Node, kind: str) -> bool:
    name = _name(node)
    if name == "baddbmm":  # beta=0: the input is ignored (Megatron/GPT-2 "reorder_and_upcast_attn")
        return kind == "qk" and _number(node.kwargs.get("beta", 1)) == 0 and len(node.args) == 3
    if name in _MATMULS:
        return len(node.args) == 2 and not node.kwargs
    return name == "einsum" and _einsum_kind(node) == kind


def _softmax_dim_ok(node: fx.Node) -> bool:
    nd = len(_shape(node))
    dim = _number(_arg(node, 1, "dim"))  # x.softmax(dim) and softmax(x, dim): args[1] either way
    return isinstance(dim, int) and nd > 0 and dim % nd == nd - 1


def _softmax_dtype(node: fx.Node):
    if node.op == "call_method":
        return _arg(node, 2, "dtype")
    if node.target is F.softmax:
        return _arg(node, 3, "dtype")
    return _arg(node, 2, "dtype")


def _same_scores(a: tuple, b: tuple) -> bool:
    """Same (N, M) in the last two dims and the same number of (batch, head) rows before them."""
    if len(a) < 2 or len(b) < 2 or not (_same(a[-1], b[-1]) and _same(a[-2], b[-2])):
        return False
    return _same(math.prod(a[:-2]), math.prod(b[:-2]))


def _path_to(start: fx.Node, is_end, depth: int) -> list[fx.Node] | None:
    """The first forward path [start, ..., end] within `depth` steps whose inner nodes keep the
    scores' shape and are not products (so one layer's output never reaches the next layer's softmax)."""
    shape = _shape(start)
    frontier = [[start]]
    for _ in range(depth):
        nxt = []
        for path in frontier:
            for user in path[-1].users:
                if is_end(user, path[-1]):
                    return path + [user]
                s = _shape(user)
                if (user.op in ("call_function", "call_method") and _name(user) not in _MATMULS + ("baddbmm", "einsum", "sdpa")
                        and _same_scores(s, shape)):
                    nxt.append(path + [user])
        frontier = nxt
    return None


def _dropout_ok(node: fx.Node) -> None:
    if node.target is torch.dropout:
        p, train = _arg(node, 1, "p"), _arg(node, 2, "train")
    else:
        p, train = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
    p, train = _number(p), _number(train) if train is not None else None
    if p is None or train is None:
        raise _Keep("dropout with a non-constant probability or mode")
    if p != 0 and train:
        raise _Keep(f"dropout p={p} in training (the kernels have no RNG)")


class _Finder:
    def __init__(self, graph: fx.Graph, cfg: config.Config | None = None):
        self.graph = graph
        self.masks = _MaskEval()
        self.reference = (cfg or config.current()).reference

    # ------------------------------------------------------------------ shared checks and the match
    def _match(self, out: fx.Node, qo: _Operand, ko: _Operand, vo: _Operand, causal: bool, scale: float,
               keep: str | None = None, mixed: bool = False, mask: fx.Node | None = None) -> Match:
        exs = [example(o.node) for o in (qo, ko, vo)]
        device = exs[0].device if isinstance(exs[0], torch.Tensor) else None
        needs_grad = any(isinstance(e, torch.Tensor) and e.requires_grad for e in exs)
        m = Match(FAMILY, [out], needs_grad=needs_grad, device=device, reason=keep)
        if keep is None:
            try:
                m.target, m.args, m.outputs = self._call(out, qo, ko, vo, causal, scale, mixed, mask)
            except _Keep as e:
                m.reason = str(e)
        return m

    def _call(self, out, qo, ko, vo, causal, scale, mixed=False, mask=None):
        exs = [example(o.node) for o in (qo, ko, vo)]
        if not all(isinstance(e, torch.Tensor) for e in exs):
            raise _Keep("q/k/v example values are missing")
        dts = [o.dtype() for o in (qo, ko, vo)]
        if len(set(dts)) != 1 or not dts[0].is_floating_point:
            raise _Keep(f"q/k/v dtypes {[str(d) for d in dts]} (the op needs one float dtype)")
        dtype = dts[0]
        if isinstance(example(out), torch.Tensor) and example(out).dtype != dtype:
            raise _Keep(f"the output dtype {example(out).dtype} differs from the inputs' {dtype}")
        if len({e.device for e in exs}) != 1:
            raise _Keep("q/k/v are on different devices")
        merged = {o.merged for o in (qo, ko, vo)}
        if len(merged) != 1 and not mixed:
            raise _Keep("only some of q/k/v are (B*H, N, D) views of 4-D tensors")
        ranks = {e.dim() for e in exs}
        if ranks != {4} and ranks != {3}:
            raise _Keep(f"q/k/v of ranks {sorted(e.dim() for e in exs)} (the op takes 4-D, or 3-D batched)")
        transposed = tuple(o.needs_transpose() for o in (qo, ko, vo))
        shapes = []
        for tr, e in zip(transposed, exs):
            s = list(e.shape)
            if tr:
                s[-2], s[-1] = s[-1], s[-2]
            shapes.append(s)
        (qs, ks, vs) = shapes
        if not _same(ks[-1], qs[-1]):
            raise _Keep(f"q and k head dims differ ({qs[-1]} vs {ks[-1]})")
        if not _same(vs[-1], qs[-1]):
            raise _Keep(f"value head dim {vs[-1]} differs from the query/key head dim {qs[-1]}")
        if not _same(ks[-2], vs[-2]):
            raise _Keep("k and v lengths differ")
        if not (_same(qs[0], ks[0]) and _same(ks[0], vs[0])):
            raise _Keep("the batch is broadcast between q and k/v")
        if len(qs) == 4:
            hq, hk, hv = qs[1], ks[1], vs[1]
            if not _same(hk, hv):
                raise _Keep(f"k and v head counts differ ({hk} vs {hv})")
            if not _known(hq % hk == 0):
                raise _Keep(f"query heads ({hq}) are not a multiple of key/value heads ({hk})")
        elif ko.repeated != 1 or vo.repeated != 1 or not _same(qs[0], ks[0]):
            raise _Keep("3-D attention with repeated key/value heads")
        if not (scale > 0 and math.isfinite(scale)):
            raise _Keep(f"scale {scale} is not a positive finite number")
        if exs[0].device.type == "cuda" and not self.reference:
            why = attention_ops.kernel_supports(dtype, _number(qs[-1]))
            if why is not None:
                raise _Keep(why)
        if mixed and not (len(_shape(out)) == 4 and all(_same(a, b) for a, b in zip(_shape(out)[:2], qs[:2]))):
            raise _Keep("the 3-D scores are viewed to heads that differ from q's")
        heads = "4d" if len(qs) == 4 and (mixed or not qo.merged) else ("merged" if qo.merged else "none")
        args = (qo.arg(), ko.arg(), vo.arg(), bool(causal), float(scale))
        if heads == "merged":
            back = self._merged_back(out, qs)
            if back is not None:
                heads, out = "4d", back
        # The op's o is a transposed view of a (B, N, H, D) buffer; a later `.view` of the eager
        # (contiguous) result may not be expressible on it, so those users get a contiguous copy.
        contiguous = any(_name(u) in ("view", "view_as") for u in out.users)
        if mask is not None:  # values known only at run time: the op checks them (tk::attention_masked)
            if heads != "4d" or any(transposed) or contiguous:
                raise _Keep("the mask's values are known only at run time and the layout needs an adapter")
            if getattr(example(mask), "requires_grad", False):
                raise _Keep("the mask/bias requires grad (a learned bias)")
            return torch.ops.tk.attention_masked.default, (qo.arg(), ko.arg(), vo.arg(), mask, float(scale)), [out, None]
        if heads == "4d" and not any(transposed) and not contiguous:
            return torch.ops.tk.attention.default, args, [out, None]
        return attention_adapter, args + (transposed, heads, contiguous), [out]

    @staticmethod
    def _merged_back(out: fx.Node, q4) -> fx.Node | None:
        """The single user that views the (B*H, N, D) output back to (B, H, N, D), if any."""
        if len(out.users) != 1:
            return None
        (user,) = out.users
        if _name(user) not in ("view", "reshape") or user.args[0] is not out:
            return None
        s = _shape(user)
        if len(s) == 4 and all(_same(a, b) for a, b in zip(s, q4)):
            return user
        return None

    # ------------------------------------------------------------------ SDPA
    def sdpa(self, node: fx.Node) -> Match:
        q, k, v = (_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        qo = _peel(q, allow_merge=False, allow_scale=True)
        ko = _peel(k, allow_merge=False, allow_scale=True)
        vo = _peel(v, allow_merge=False, allow_scale=False)
        mask = _arg(node, 3, "attn_mask")
        dropout_p = _number(_arg(node, 4, "dropout_p", 0.0))
        is_causal = _number(_arg(node, 5, "is_causal", False))
        scale = _arg(node, 6, "scale")
        try:
            if qo.transposed or ko.transposed or vo.transposed:
                qo, ko, vo = _Operand(q), _Operand(k), _Operand(v)
            for n in (qo.node, ko.node, vo.node):
                if any(_in_place(u) for u in n.users):
                    raise _Keep(f"`{n.name}` is modified in place")
            if dropout_p is None or dropout_p != 0:
                raise _Keep(f"SDPA dropout_p={_arg(node, 4, 'dropout_p')} (SDPA drops even in eval; no RNG kernel)")
            if is_causal is None:
                raise _Keep("SDPA is_causal is not a constant")
            causal = bool(is_causal)
            runtime_mask = None
            if mask is not None:
                try:
                    causal = self._sdpa_mask(mask, _shape(node)[:-1] + (_shape(k)[-2],))
                except _Keep:
                    if is_causal or not _from_graph_input(mask):
                        raise
                    runtime_mask = mask
            d = _number(_shape(q)[-1]) if _shape(q) else None
            if scale is None:
                if d is None:
                    raise _Keep("default scale of a symbolic head dim")
                scale = 1.0 / math.sqrt(d)
            scale = _number(scale)
            if scale is None:
                raise _Keep("SDPA scale is not a constant")
            scale = float(scale) * qo.scale * ko.scale
            if len(_shape(q)) not in (3, 4):
                raise _Keep(f"SDPA inputs of rank {len(_shape(q))} (the op takes 4-D)")
        except _Keep as e:
            return self._match(node, qo, ko, vo, False, 1.0, keep=str(e))
        return self._match(node, qo, ko, vo, causal, scale, mask=runtime_mask)

    def _sdpa_mask(self, mask: fx.Node, score_shape: tuple) -> bool:
        try:
            v = self.masks(mask)
        except _Keep as e:
            raise _Keep(f"attn_mask is not provably causal: {e}") from None
        ex = example(mask)
        allowed = _as_pred(v) if ex.dtype == torch.bool else _additive_allowed(v)
        return _allowed_kind(allowed, score_shape)

    # ------------------------------------------------------------------ eager
    def eager(self, qk: fx.Node) -> Match | None:
        softmax_path = _path_to(qk, lambda u, prev: _name(u) == "softmax", depth=10)
        if softmax_path is None:
            return None
        sm = softmax_path[-1]

        def is_pv(u, prev):
            return _is_product(u, "pv") and _operands(u)[0] is prev

        pv_path = _path_to(sm, is_pv, depth=6)
        if pv_path is None:
            return None
        pv = pv_path[-1]
        chain = softmax_path[1:-1]
        after = pv_path[1:-1]
        q, kt = _operands(qk)
        _, v = _operands(pv)
        want_t = _name(qk) != "einsum"
        # (B*H, N, D) views are peeled back to (B, H, N, D) on the side(s) that multiply in 3-D
        qk_3d, pv_3d = len(_shape(qk)) == 3, len(_shape(pv)) == 3
        qo = _peel(q, qk_3d, allow_scale=True)
        ko = _peel(kt, qk_3d, allow_scale=True)
        vo = _peel(v, pv_3d, allow_scale=False)
        # scores made in 3-D and viewed to 4-D before a 4-D value product: fine when the 4-D output's
        # (B, H) are q's, which pins the scores' view to the same (B, H) split (checked in _call)
        mixed = qo.merged and ko.merged and not vo.merged and not pv_3d
        if len({qo.merged, ko.merged, vo.merged}) != 1 and not mixed:
            qo, ko, vo = _peel(q, False, True), _peel(kt, False, True), _peel(v, False, False)
            mixed = False
        ko.want_t = want_t
        try:
            for n in [qk] + chain + [sm] + after + [qo.node, ko.node, vo.node]:
                if any(_in_place(u) for u in n.users):
                    raise _Keep(f"`{n.name}` is modified in place")
            for n in [qk] + chain + [sm] + after:
                if len(n.users) != 1:
                    raise _Keep(f"the attention weights (`{n.name}`) are also used elsewhere "
                                "(e.g. output_attentions)")
            if not _softmax_dim_ok(sm):
                raise _Keep("softmax is not over the key dimension")
            sdt = _softmax_dtype(sm)
            if sdt is not None and sdt not in (torch.float32, torch.float64, example(q).dtype):
                raise _Keep(f"softmax in {sdt}")
            q_dtype = qo.dtype()
            scale, causal, runtime_mask = self._scores_chain(qk, chain, q_dtype)
            if _name(qk) == "baddbmm":
                alpha = _positive_const(qk.kwargs.get("alpha", 1))
                if alpha is None:
                    raise _Keep("baddbmm alpha is not a positive constant")
                scale *= alpha
            for n in after:
                self._probs_step(n, q_dtype)
            scale *= qo.scale * ko.scale
        except _Keep as e:
            return self._match(pv, qo, ko, vo, False, 1.0, keep=str(e))
        return self._match(pv, qo, ko, vo, causal, scale, mixed=mixed, mask=runtime_mask)

    def _cast_ok(self, n: fx.Node, q_dtype) -> None:
        dt = example(n).dtype
        if dt not in (torch.float32, torch.float64, q_dtype):
            raise _Keep(f"the scores are cast to {dt}, below the inputs' {q_dtype}")

    def _scores_chain(self, qk: fx.Node, chain: list[fx.Node], q_dtype) -> tuple[float, bool, fx.Node | None]:
        """(scale, causal, mask whose values are known only at run time, or None)."""
        scale, causal, runtime_mask = 1.0, False, None
        shape = _shape(qk)
        prev = qk
        for n in chain:
            name = _name(n)
            others = [a for a in list(n.args) + list(n.kwargs.values()) if a is not prev]
            if name in ("contiguous", "clone", "view", "reshape"):
                pass  # the path search already checked that views keep (rows, N, M)
            elif name in _CASTS:
                self._cast_ok(n, q_dtype)
            elif name in ("mul", "div") and len(n.args) == 2 and not n.kwargs:
                c = _positive_const(others[0]) if len(others) == 1 else None
                if runtime_mask is not None:
                    raise _Keep("the scores are scaled after a run-time mask was added (SDPA adds it after scaling)")
                if c is None or (name == "div" and n.args[0] is not prev):
                    runtime = len(others) == 1 and isinstance(others[0], fx.Node) \
                        and not isinstance(example(others[0]), torch.Tensor)
                    raise _Keep("the scores are scaled by a run-time value (dynamic=True passes float attributes "
                                "as tensors)" if runtime else
                                f"the scores are scaled by a non-constant or non-positive `{n.name}`")
                scale *= c if name == "mul" else 1.0 / c
            elif name in ("add",) and len(n.args) == 2 and not n.kwargs:
                try:
                    kind = _allowed_kind(self._additive(others[0]), shape)  # evaluated for every mask: each must be provable
                except _Keep:
                    m = others[0] if len(others) == 1 else None
                    if runtime_mask is not None or causal or not _from_graph_input(m) \
                            or not isinstance(example(m), torch.Tensor) or not example(m).is_floating_point():
                        raise
                    runtime_mask, kind = m, False
                causal = causal or kind
            elif name == "masked_fill" and n.args[0] is prev:
                fill = _number(_arg(n, 2, "value"))
                if fill is None:
                    try:
                        fv = self.masks(_arg(n, 2, "value"))
                        fill = fv.c if isinstance(fv, Aff) and not fv.coefs else None
                    except _Keep:
                        fill = None
                if not _fill_ok(fill):
                    raise _Keep(f"masked_fill value {_arg(n, 2, 'value')} does not vanish in softmax")
                masked = self._bool_mask(_arg(n, 1, "mask"))
                kind = _allowed_kind(_not(masked), shape)  # evaluated for every mask: each must be provable
                causal = causal or kind
            elif name == "where" and len(n.args) == 3:
                cond, a, b = n.args
                if a is prev:
                    fill, allowed = b, True
                elif b is prev:
                    fill, allowed = a, False
                else:
                    raise _Keep("where() on the scores in an unknown form")
                fv = self._const_value(fill)
                if not _fill_ok(fv):
                    raise _Keep(f"where() fill value {fill} does not vanish in softmax")
                p = self._bool_mask(cond)
                kind = _allowed_kind(p if allowed else _not(p), shape)  # evaluated for every mask: each must be provable
                causal = causal or kind
            elif name == "tanh":
                raise _Keep("softcapping (tanh) of the scores")
            elif name in ("add", "sub"):
                raise _Keep(f"a tensor is combined with the scores by `{n.name}` (bias)")
            else:
                raise _Keep(f"`{n.name}` ({name or n.target}) between the score product and the softmax")
            if not _same_scores(_shape(n), shape):
                raise _Keep(f"`{n.name}` broadcasts the scores to a larger shape")
            prev = n
        if runtime_mask is not None and causal:
            raise _Keep("a proven causal mask and a run-time mask are both applied")
        return scale, causal, runtime_mask

    def _const_value(self, x):
        v = _number(x)
        if v is not None:
            return v
        try:
            fv = self.masks(x)
        except _Keep:
            return None
        return fv.c if isinstance(fv, Aff) and not fv.coefs else None

    def _bool_mask(self, x) -> Pred:
        try:
            return _as_pred(self.masks(x))
        except _Keep as e:
            raise _Keep(f"mask is not provably causal: {e}") from None

    def _additive(self, x):
        try:
            v = self.masks(x)
        except _Keep as e:
            raise _Keep(f"additive mask/bias is not provably causal: {e}") from None
        return _additive_allowed(v)

    def _probs_step(self, n: fx.Node, q_dtype) -> None:
        name = _name(n)
        if name in ("contiguous", "clone", "view", "reshape"):
            return
        if name in _CASTS:
            self._cast_ok(n, q_dtype)
            return
        if name == "dropout":
            _dropout_ok(n)
            return
        raise _Keep(f"`{n.name}` ({name or n.target}) between the softmax and the value product")


def find(graph: fx.Graph, cfg: config.Config | None = None) -> Iterator[Match]:
    finder = _Finder(graph, cfg)
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        name = _name(node)
        try:
            if name == "sdpa":
                yield finder.sdpa(node)
            elif name in _MATMULS + ("baddbmm", "einsum") and _is_product(node, "qk"):
                m = finder.eager(node)
                if m is not None:
                    yield m
        except Exception as exc:  # noqa: BLE001 - an odd graph must not stop the other families' rewrites
            log.debug("tk_inductor: attention matcher failed on %s", node.format_node(), exc_info=True)
            yield Match(FAMILY, [node], reason=f"matcher could not analyse `{node.name}` ({type(exc).__name__}: {exc})")


def output_mask_kinds(graph: fx.Graph) -> dict[int, str]:
    """The graph's outputs that are masks proven causal or all-visible over their own last two dims, by output
    position: {i: "causal" | "full"}. A graph that makes the mask hands it to the layers' graphs as an input when
    DDP splits the graph or a graph break falls between them; the backend records these proofs on the output
    tensors at run time (ops.attention.prove_mask), so the consumers' `tk::attention_masked` need not read the
    values of each step's new mask (a wait for the GPU)."""
    out = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    if out is None:
        return {}
    values = out.args[0]
    flat = list(values) if isinstance(values, (tuple, list)) else [values]
    finder = _Finder(graph)  # the matcher's own mask proof, over the mask's own box
    kinds: dict[int, str] = {}
    for i, node in enumerate(flat):
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            continue
        ex = example(node)
        if not isinstance(ex, torch.Tensor) or ex.dim() < 2 or not (ex.dtype == torch.bool or ex.is_floating_point()):
            continue
        try:
            kinds[i] = "causal" if finder._sdpa_mask(node, _shape(node)) else "full"
        except _Keep:
            continue
        except Exception:  # noqa: BLE001  (an analysis bug must cost a value check, never the compile)
            log.debug("tk_inductor: output mask analysis failed on %s", node.name, exc_info=True)
    return kinds
