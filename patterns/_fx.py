"""The matchers' graph-reading vocabulary.

- calls: `is_call` (exact targets), `name` (what a call computes, across function, method and operator spellings)
  and `kind` (its coarsening), `arg`, `tensor`, `shape`, `dtype`;
- values: `strip` (value-preserving nodes), `scaled` (python-scalar factors), `evaluate_constant` (subgraphs of
  constants: the mask proofs), `eq`/`shapes_eq` (sizes equal without new guards), `static_int`;
- dtype casts: `cast_dtype`, `upcast_source`, `fused_cast`;
- index notation: `view_chain`/`peel_to` (views as renamed index letters), `contraction` (einsum, matmul, broadcast
  products and sums read as one Σ Π) and `unify` (a contraction against a template).
"""
from __future__ import annotations

import itertools
import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from tk_inductor.autocast import AUTOCAST_CAST
from tk_inductor.rewrite import example


# ---------------------------------------------------------------------------- calls

def is_call(node: Any, fns: set, method: str | None = None) -> bool:
    """`node` calls one of `fns`, or the tensor method `method`."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target in fns:
        return True
    return method is not None and node.op == "call_method" and node.target == method


def arg(node: fx.Node, i: int, key: str, default=None):
    """Argument `i` of a call, whether passed by position or as `key=`."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(key, default)


def tensor(node: Any) -> torch.Tensor | None:
    """The example tensor of a node, or None when it is not a tensor."""
    v = example(node) if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


# One vocabulary for every matcher. `name` says what a call computes, fine-grained: view and reshape, bmm and matmul
# stay apart (the mask prover and attention's operand walk need them apart); `kind` is its coarsening, one name per
# computation, for the contraction readers. Functions and operators by target, tensor methods by method name.
_NAMES: dict[Any, str] = {
    operator.add: "add", torch.add: "add", torch.Tensor.add: "add", operator.sub: "sub", torch.sub: "sub",
    torch.Tensor.sub: "sub", operator.mul: "mul", torch.mul: "mul", torch.Tensor.mul: "mul",
    operator.truediv: "div", torch.div: "div", torch.true_divide: "div", torch.Tensor.div: "div",
    operator.neg: "neg", torch.neg: "neg", torch.Tensor.neg: "neg", operator.pow: "pow", torch.pow: "pow",
    torch.Tensor.pow: "pow",
    operator.le: "le", torch.le: "le", operator.lt: "lt", torch.lt: "lt", operator.ge: "ge", torch.ge: "ge",
    operator.gt: "gt", torch.gt: "gt", operator.eq: "eq", torch.eq: "eq", operator.ne: "ne", torch.ne: "ne",
    torch.greater_equal: "ge", torch.greater: "gt", torch.less_equal: "le", torch.less: "lt",
    operator.and_: "and", torch.logical_and: "and", torch.bitwise_and: "and",
    operator.or_: "or", torch.logical_or: "or", torch.bitwise_or: "or",
    operator.invert: "not", torch.logical_not: "not", torch.bitwise_not: "not",
    torch.where: "where", torch.masked_fill: "masked_fill", torch.Tensor.masked_fill: "masked_fill",
    torch.tril: "tril", torch.Tensor.tril: "tril", torch.triu: "triu", torch.Tensor.triu: "triu",
    torch.arange: "arange", torch.ones: "ones", torch.zeros: "zeros", torch.full: "full",
    torch.ones_like: "ones_like", torch.zeros_like: "zeros_like", torch.full_like: "full_like",
    torch.tensor: "tensor", torch.scalar_tensor: "tensor", operator.getitem: "getitem",
    torch.unsqueeze: "unsqueeze", torch.Tensor.unsqueeze: "unsqueeze", torch.squeeze: "squeeze",
    torch.reshape: "reshape", torch.Tensor.reshape: "reshape", torch.Tensor.view: "view",
    torch.transpose: "transpose", torch.Tensor.transpose: "transpose", torch.swapaxes: "transpose",
    torch.swapdims: "transpose", torch.permute: "permute", torch.Tensor.permute: "permute",
    torch.flatten: "flatten", torch.Tensor.flatten: "flatten", torch.diff: "diff",
    torch.cumsum: "cumsum", torch.Tensor.cumsum: "cumsum", torch.sum: "sum", torch.Tensor.sum: "sum",
    torch.exp: "exp", torch.Tensor.exp: "exp", torch.reciprocal: "reciprocal", torch.Tensor.reciprocal: "reciprocal",
    torch.broadcast_to: "expand", torch.Tensor.expand: "expand",
    torch.matmul: "matmul", operator.matmul: "matmul", torch.Tensor.matmul: "matmul", torch.bmm: "bmm",
    torch.Tensor.bmm: "bmm", torch.einsum: "einsum", torch.baddbmm: "baddbmm",
    torch.softmax: "softmax", F.softmax: "softmax", torch.Tensor.softmax: "softmax", torch.dropout: "dropout",
    F.dropout: "dropout", F.scaled_dot_product_attention: "sdpa", torch.tanh: "tanh", F.elu: "elu",
    torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat", torch.clone: "clone",
    torch.repeat_interleave: "repeat_interleave", torch.Tensor.repeat_interleave: "repeat_interleave",
    F.pad: "pad", torch._C._nn.pad: "pad", torch.ops.aten.mT: "mT", torch.narrow: "narrow", torch.Tensor.narrow: "narrow",
    torch.stack: "stack", torch.unbind: "unbind", torch.Tensor.unbind: "unbind", torch.select: "select",
    torch.Tensor.select: "select",
}
_METHOD_NAMES = {"__and__": "and", "logical_and": "and", "__or__": "or", "logical_or": "or", "logical_not": "not",
                 "__invert__": "not", "bitwise_not": "not", "truediv": "div", "true_divide": "div", "divide": "div",
                 "multiply": "mul", "broadcast_to": "expand", "expand_as": "expand", "greater_equal": "ge",
                 "less_equal": "le", "greater": "gt", "less": "lt", "swapaxes": "transpose", "swapdims": "transpose",
                 # operators on tensors recorded as method calls (e.g. `a == b` in transformers 5.17's packed mask)
                 "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
                 "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div", "__neg__": "neg",
                 "__pow__": "pow", "__matmul__": "matmul"}
# `kind`: the coarsening, and the names it gives at all (the computations the contraction readers know)
_COARSE = {"view": "reshape", "bmm": "matmul", "not": "invert"}
_KINDS = frozenset({"matmul", "mul", "div", "add", "sub", "neg", "pow", "invert", "getitem", "einsum", "exp", "cumsum",
                    "sum", "tril", "triu", "masked_fill", "where", "cat", "softmax", "elu", "flatten", "unsqueeze",
                    "transpose", "permute", "ones_like", "reciprocal", "reshape", "pad", "repeat_interleave",
                    "zeros_like", "expand", "mT", "narrow", "zeros", "stack", "unbind", "select"})
_KIND_METHODS = _KINDS | {"float", "to", "type", "contiguous", "size", "new_zeros", "new_ones"}


def name(node) -> str | None:
    """What a call computes, fine-grained (functions, operators and tensor methods alike); any other method by its
    own name; None for anything else."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        try:
            return _NAMES.get(node.target)
        except TypeError:  # an unhashable target
            return None
    if node.op == "call_method":
        return _METHOD_NAMES.get(node.target, node.target)
    return None


def kind(node) -> str | None:
    """The canonical name of what a node computes: `name` coarsened (view is a reshape, bmm a matmul), among the
    computations the contraction readers know (a few more for methods: casts, contiguous, size, new_*)."""
    n = name(node)
    if n is None:
        return None
    n = _COARSE.get(n, n)
    return n if n in (_KIND_METHODS if node.op == "call_method" else _KINDS) else None


def needs_grad(*nodes) -> bool:
    """Whether any node's example value requires grad (the graph is traced for training)."""
    return any(getattr(example(n), "requires_grad", False) for n in nodes)


def shape(node) -> tuple | None:
    ex = example(node)
    return tuple(ex.shape) if isinstance(ex, torch.Tensor) else None


def rank(node) -> int:
    """The number of dimensions of node's tensor; 0 for anything else."""
    return len(shape(node) or ())


def dtype(node):
    ex = example(node)
    return ex.dtype if isinstance(ex, torch.Tensor) else None


def is_tensor(node) -> bool:
    return isinstance(example(node), torch.Tensor)


class Keep(Exception):
    """The subgraph is recognised (attention, a mask) but cannot be replaced; the message is the reason."""


# ---------------------------------------------------------------------------- values

def scalar(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def number(x):
    """x as a python number when it is a constant: an int, float or bool, a SymInt/SymFloat with a fixed value, or a
    node whose example value is one; else None."""
    x = example(x)
    if isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, torch.SymInt):
        value = getattr(x.node, "maybe_as_int", lambda: None)()
        return value if isinstance(value, int) else None
    if isinstance(x, torch.SymFloat):
        try:
            expr = x.node.expr
            return float(expr) if expr.is_number else None
        except Exception:  # noqa: BLE001 - an expression we cannot read is not a constant
            return None
    return None


def close(a: float | None, b: float, rel: float = 1e-6) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def strip(node):
    """See through nodes that do not change values: dtype/device-preserving `.to`/`.float()`,
    `.contiguous()`, `.type(same)`; and autocast's casts (tk_inductor/autocast.py): autocast is a precision
    policy, and the ops compute with fp32 accumulation, at least as precisely as the autocast dtype."""
    while kind(node) in ("to", "float", "type", "contiguous"):
        src = node.args[0]
        if not is_tensor(src) or not shapes_eq(shape(src), shape(node)):
            break
        if dtype(src) != dtype(node) and not node.meta.get(AUTOCAST_CAST):
            break
        node = src
    return node


def through_upcasts(node):
    """Through value-preserving nodes (`strip`) and `.float()`/`.to(float32)` upcasts: the lower-precision source
    (exact to upcast). Unlike `upcast_source`, it also sees through autocast's casts and chains of them."""
    node = strip(node)
    while kind(node) in ("to", "float", "type"):
        src = node.args[0]
        if not is_tensor(src) or dtype(node) != torch.float32 or dtype(src) not in (torch.float32, torch.bfloat16, torch.float16):
            break
        node = strip(src)
    return node


def scaled(node):
    """(base, factor) with node == base * factor for a python-scalar chain of mul/div/neg."""
    factor = 1.0
    while True:
        node = strip(node)
        k = kind(node)
        if k in ("mul", "div") and len(node.args) >= 2 and not node.kwargs:
            a, b = node.args[0], node.args[1]
            if k == "mul" and scalar(a) is not None and is_tensor(b):
                factor *= scalar(a)
                node = b
                continue
            if scalar(b) is not None and is_tensor(a) and (k == "mul" or scalar(b) != 0):
                factor = factor * scalar(b) if k == "mul" else factor / scalar(b)
                node = a
                continue
        if k == "neg":
            factor = -factor
            node = node.args[0]
            continue
        return node, factor


def evaluate_constant(node, _depth: int = 0):
    """Run a subgraph built only from constants (a mask made by ones/tril/arange ...).

    Returns the tensor, or None if it depends on any graph input, random op or unknown
    size: only then is the mask's value a proof, not a guess."""
    if _depth > 40:
        return None
    if isinstance(node, (list, tuple)):
        vals = [evaluate_constant(a, _depth + 1) for a in node]
        if any(v is None and a is not None for v, a in zip(vals, node)):
            return None
        return type(node)(vals)
    if not isinstance(node, fx.Node):
        if isinstance(node, torch.device):
            return torch.device("cpu")
        return node
    if node.op not in ("call_function", "call_method"):
        return None
    name = str(getattr(node.target, "__name__", node.target))
    if "rand" in name or "empty" in name or "normal" in name or "bernoulli" in name:
        return None
    args = [evaluate_constant(a, _depth + 1) for a in node.args]
    if any(v is None and a is not None for v, a in zip(args, node.args)):
        return None
    kwargs = {}
    for key, val in node.kwargs.items():
        v = evaluate_constant(val, _depth + 1)
        if v is None and val is not None:
            return None
        kwargs[key] = v
    if any(isinstance(v, torch.SymInt) for v in [*args, *kwargs.values()]):
        return None
    try:
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)
    except Exception:
        return None


def static_int(x):
    """x as a python int when it is one, even behind a SymInt with a constant value; else None (`number`, ints only)."""
    n = number(x)
    return n if isinstance(n, int) else None


def known(cond) -> bool:
    """True only if `cond` (a bool, or a condition on SymInts) holds for every value of its symbols; adds no guard."""
    if isinstance(cond, bool):
        return cond
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(cond))
    except Exception:  # noqa: BLE001 - unknown means "not provable"
        return False


def eq(a, b) -> bool:
    """Sizes provably equal (ints, SymInts or nodes producing them), adding no shape guards."""
    a, b = example(a), example(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if not (isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt))):
        return False
    return known(a == b)


def shapes_eq(s, t) -> bool:
    return s is not None and t is not None and len(s) == len(t) and all(eq(a, b) for a, b in zip(s, t))


# ---------------------------------------------------------------------------- dtype casts

# Calls that change at most a tensor's dtype or device.
_CASTS = {"to", "type", "type_as", "float", "half", "bfloat16", "double", "bool", "long", "int"}
_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}


def cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype `node` casts its input to (`.to(dtype)`, `.float()`, `.half()`, `.bfloat16()`, `.type_as(t)`), or
    None when it is not a cast on the same device."""
    if not isinstance(node, fx.Node) or node.op != "call_method" or not node.args:
        return None
    t, src = tensor(node), tensor(node.args[0])
    if t is None or src is None or t.device != src.device or tuple(t.shape) != tuple(src.shape):
        return None
    if node.target in _CAST_METHODS:
        return _CAST_METHODS[node.target]
    if node.target == "type_as":
        return t.dtype
    if node.target not in ("to", "type"):
        return None
    dtypes = [a for a in list(node.args[1:]) + list(node.kwargs.values()) if isinstance(a, torch.dtype)]
    others = [a for a in list(node.args[1:]) + list(node.kwargs.values())
              if not isinstance(a, (torch.dtype, bool)) and a is not None]
    if len(dtypes) != 1 or others or t.dtype != dtypes[0]:  # .to(device), .to(other) ...: not a plain cast
        return None
    return dtypes[0]


def upcast_source(node: Any) -> Any:
    """`node` with an exact widening cast (16-bit to fp32) stripped: the value it casts. Other nodes as they are."""
    if cast_dtype(node) == torch.float32:
        src = tensor(node.args[0])
        if src is not None and src.dtype in (torch.float16, torch.bfloat16):
            return node.args[0]
    return node


def fused_cast(out: fx.Node, dtypes) -> tuple[fx.Node, torch.dtype] | None:
    """The cast that is `out`'s only use, to one of `dtypes` and keeping out's strides: (cast node, its dtype). An op
    that writes that dtype directly rounds the same value once, as the cast does (autocast's cast in front of a
    matmul, made explicit by tk_inductor/autocast.py)."""
    if len(out.users) != 1:
        return None
    user = next(iter(out.users))
    dtype = cast_dtype(user)
    tu, to = tensor(user), tensor(out)
    if dtype is None or dtype not in dtypes or user.args[0] is not out or to is None or dtype == to.dtype:
        return None
    if tu.stride() != to.stride():
        return None
    return user, dtype


# ---------------------------------------------------------------------------- index notation

def full_index(index, rank: int):
    """A getitem index as one entry per dim: Ellipsis expanded, trailing dims as full slices (None: an index this
    matcher does not read, such as a tensor or a new axis)."""
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1 or any(i is None or not isinstance(i, (int, slice, type(Ellipsis))) for i in index):
        return None
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (rank - len(index) + 1) + index[k + 1:]
    return index + (slice(None),) * (rank - len(index))


def _index_entry(entry, size):
    """One dim's index entry in a normal form where the size is known: t[..., -1] is t[..., T - 1], t[..., -1:] is
    t[..., T - 1:] and t[..., :] is t[..., 0:T]."""
    n = static_int(size)
    if n is None:
        return entry
    if isinstance(entry, int) and not isinstance(entry, bool) and -n <= entry < n:
        return entry % n
    if isinstance(entry, slice) and all(v is None or isinstance(v, int) for v in (entry.start, entry.stop, entry.step)):
        return slice(*entry.indices(n))
    return entry


def indexes(node, index) -> bool:
    """`node` is `t[index]`, in any spelling of the same index (`t[:, :, :, -1]`, `t[..., -1]`, `t[..., T - 1]`)."""
    if kind(node) != "getitem" or shape(node.args[0]) is None:
        return False
    sizes = shape(node.args[0])
    got, want = full_index(node.args[1], len(sizes)), full_index(index, len(sizes))
    if got is None or want is None:
        return False
    return all(_index_entry(g, n) == _index_entry(w, n) for g, w, n in zip(got, want, sizes))


def peel_to(node, letters: str, want: str):
    """The view of `node` (positions named by `letters`) whose positions are exactly `want`,
    e.g. peel_to(x[..., None], "abcz", "abc") -> x; None if there is none."""
    for n, l in view_chain(node, letters) or ():
        if l == want:
            return n
    return None


def view_chain(node, letters: str):
    """Every (node, letters) met while peeling views off `node`, outermost first (each holds the
    same values under another index naming); None if some view is not representable."""
    chain = []
    while True:
        node = strip(node)
        if shape(node) is None:
            return None
        k = kind(node)
        rank = len(letters)
        if len(shape(node)) == rank:
            chain.append((node, letters))
        if k == "getitem" and isinstance(node.args[1], tuple):
            idx = node.args[1]
            if not all(i is None or i is Ellipsis or i == slice(None) for i in idx) or sum(i is Ellipsis for i in idx) > 1:
                return chain or None
            base_rank = len(shape(node.args[0]) or ())
            n_ellipsis = base_rank - sum(i is not None and i is not Ellipsis for i in idx)
            pos, kept = 0, []
            for i in idx:
                if i is Ellipsis:
                    kept.extend(letters[pos:pos + n_ellipsis])
                    pos += n_ellipsis
                elif i is None:
                    pos += 1
                else:
                    kept.append(letters[pos])
                    pos += 1
            kept.extend(letters[pos:])
            letters, node = "".join(kept), node.args[0]
        elif k == "unsqueeze":
            d = arg(node, 1, "dim") % rank
            letters, node = letters[:d] + letters[d + 1:], node.args[0]
        elif k == "reshape" and _inserted_one(node) is not None:  # einops' way to add an axis
            d = _inserted_one(node)
            letters, node = letters[:d] + letters[d + 1:], node.args[0]
        elif k == "permute":
            dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
            dims = [d % rank for d in dims]
            base = [""] * rank
            for i, d in enumerate(dims):
                base[d] = letters[i]
            letters, node = "".join(base), node.args[0]
        elif k in ("transpose", "mT"):
            a, b = (-2, -1) if k == "mT" else (arg(node, 1, "dim0"), arg(node, 2, "dim1"))
            lst = list(letters)
            lst[a % rank], lst[b % rank] = lst[b % rank], lst[a % rank]
            letters, node = "".join(lst), node.args[0]
        else:
            return chain or None


def _inserted_one(node):
    """d if reshape `node` only inserts a size-1 axis at position d of its input (an unsqueeze)."""
    out, src = shape(node), shape(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if out is None or src is None or len(out) != len(src) + 1:
        return None
    for d in range(len(out)):
        if eq(out[d], 1) and shapes_eq(out[:d] + out[d + 1:], src):
            return d
    return None


class Contraction:
    """Σ over the letters missing from `out` of Π factors[i][0][letters_i] (einsum semantics).

    `chains[i]` lists the same factor before its view ops were peeled off (outermost first), so
    a template can bind the tensor in the layout it expects."""

    def __init__(self, factors, out, chains=None, scale=1.0):
        self.factors, self.out, self.scale = factors, out, scale  # scale: python-scalar factors met
        self.chains = chains if chains is not None else [[f] for f in factors]

    def __repr__(self):
        return f"Contraction({[(n.name, l) for n, l in self.factors]} -> {self.out})"


LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def contraction(node, *, inline=True, _fresh=None) -> Contraction | None:
    """Read einsum, broadcast products and sums of products as one contraction.

    With `inline`, factors that are themselves contractions are expanded (so HF's mul/sum
    chains and mamba's 4-operand einsum read the same)."""
    fresh = _fresh if _fresh is not None else iter(LETTERS)
    node = strip(node)
    k = kind(node)
    if k == "einsum":
        equation = node.args[0]
        operands = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else list(node.args[1:])
        if not isinstance(equation, str) or "->" not in equation:
            return None
        lhs, out = equation.replace(" ", "").split("->")
        terms = lhs.split(",")
        if len(terms) != len(operands):
            return None
        rename = {}

        def ren(s, rank):
            if "..." in s:
                n_ell = rank - (len(s) - 3)
                s = s.replace("...", "".join(f"#{i}" for i in range(n_ell)))
                parts, i = [], 0
                while i < len(s):
                    if s[i] == "#":
                        j = i + 1
                        while j < len(s) and s[j].isdigit():
                            j += 1
                        parts.append(s[i:j])
                        i = j
                    else:
                        parts.append(s[i])
                        i += 1
            else:
                parts = list(s)
            res = ""
            for p in parts:
                if p not in rename:
                    rename[p] = next(fresh)
                res += rename[p]
            return res

        factors = []
        for t, op in zip(terms, operands):
            if shape(op) is None:
                return None
            factors.append((op, ren(t, len(shape(op)))))
        out_rank = len(shape(node) or ())
        out_letters = ren(out, out_rank) if "..." in out else "".join(rename.get(c) or next(fresh) for c in out)
    elif k == "matmul":
        a, b = node.args[0], node.args[1]
        sa, sb = shape(a), shape(b)
        if sa is None or sb is None or len(sa) != len(sb) or len(sa) < 2 or sa[:-2] != sb[:-2]:
            return None
        batch = "".join(next(fresh) for _ in sa[:-2])
        n, d, m = next(fresh), next(fresh), next(fresh)
        factors = [(a, batch + n + d), (b, batch + d + m)]
        out_letters = batch + n + m
    elif k == "mul":
        a, b = node.args[0], node.args[1]
        if not (is_tensor(a) and is_tensor(b)) or node.kwargs:
            return None
        out_shape = shape(node)
        out_letters = "".join(next(fresh) for _ in out_shape)
        factors = []
        for op in (a, b):
            lead = len(out_shape) - len(shape(op))
            factors.append((op, out_letters[lead:]))
        sizes = dict(zip(out_letters, out_shape))
    elif k == "sum":
        dims = arg(node, 1, "dim")
        keepdim = arg(node, 2, "keepdim", False)
        if dims is None or node.kwargs.get("dtype") is not None:
            return None
        dims = [dims] if isinstance(dims, int) else list(dims)
        inner = contraction(node.args[0], inline=inline, _fresh=fresh)
        if inner is None:
            return None
        rank = len(inner.out)
        dims = {d % rank for d in dims}
        if keepdim:
            return None  # keepdim sums are read by callers as sum + unsqueeze
        out = "".join(c for i, c in enumerate(inner.out) if i not in dims)
        return Contraction(inner.factors, out, inner.chains, inner.scale)
    else:
        return None
    # peel views off every factor; inline nested contractions
    result, chains, total = [], [], 1.0
    for op, letters in factors:
        chain = view_chain(op, letters)
        if chain is None:
            return None
        base, base_letters = chain[-1]
        unscaled, factor = scaled(base)
        if unscaled is not base:  # python-scalar factors are collected in Contraction.scale
            chain = view_chain(unscaled, base_letters)
            if chain is None:
                return None
            base, base_letters = chain[-1]
            total *= factor
        if k == "mul" and not all(eq(sizes[c], n) for c, n in zip(base_letters, shape(base))):
            return None  # a real size-1 broadcast: not index notation we read
        if inline and kind(base) in ("einsum", "mul", "sum", "matmul"):
            inner = contraction(base, inline=True, _fresh=fresh)
            if inner is not None:
                mapping = dict(zip(inner.out, base_letters))
                if len(mapping) != len(inner.out):
                    return None
                total *= inner.scale
                for (ib, il), ichain in zip(inner.factors, inner.chains):
                    result.append((ib, "".join(mapping.get(c, c) for c in il)))
                    chains.append([(cn, "".join(mapping.get(c, c) for c in cl)) for cn, cl in ichain])
                continue
        result.append((base, base_letters))
        chains.append(chain)
    return Contraction(result, out_letters, chains, total)


def unify(c: Contraction, template: list[tuple[str, str]], out: str, bound: dict | None = None) -> dict | None:
    """Match a contraction against `template` [(variable, letters)] -> `out` up to letter renaming
    and factor order. Variables bind to nodes (pre-bound ones must agree). Returns the bindings."""
    if c is None or len(c.factors) != len(template) or len(c.out) != len(out):
        return None
    for perm in itertools.permutations(range(len(c.factors))):
        bindings = dict(bound or {})
        letter_map = dict(zip(out, c.out))
        if len(set(letter_map.values())) != len(letter_map):
            return None
        ok = True
        for (var, tletters), j in zip(template, perm):
            for node, aletters in c.chains[j]:  # the first layout that agrees with the template
                if len(tletters) != len(aletters) or bindings.get(var, node) is not node:
                    continue
                trial = dict(letter_map)
                if all(trial.setdefault(t, a) == a for t, a in zip(tletters, aletters)) \
                        and len(set(trial.values())) == len(trial):
                    letter_map = trial
                    bindings[var] = node
                    break
            else:
                ok = False
                break
        if ok:
            return bindings
    return None


def in_place(node: fx.Node) -> bool:
    """Whether the call is an in-place op (`x.add_(...)`, `index_copy_`): a name ending in one underscore."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def mutated_after(operand: fx.Node, reader: fx.Node) -> bool:
    """Whether an in-place op on `operand` runs after `reader` in the graph. Writes before the read (a static KV
    cache's `index_copy_` of the new keys, then attention over the buffer) are seen by the op that replaces the read,
    which takes its place; a later write is not proven harmless, so a matcher keeps such a read."""
    writes = [u for u in operand.users if in_place(u)]
    if not writes:
        return False
    for n in reader.graph.nodes:  # graph order: the reader first means a write follows it
        if n is reader:
            return True
        if n in writes:
            writes.remove(n)
            if not writes:
                return False
    return True
