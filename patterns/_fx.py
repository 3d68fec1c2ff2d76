"""The matchers' graph-reading vocabulary.

- calls: `is_call` (exact targets), `name` (what a call computes, across function, method and operator spellings)
  and `kind` (its coarsening), `arg`, `tensor`, `shape`, `dtype`;
- values: `strip` (value-preserving nodes), `scaled` (python-scalar factors), `evaluate_constant` (subgraphs of
  constants: the mask proofs), `eq`/`shapes_eq` (sizes equal without new guards), `static_int`;
- dtype casts: `cast_dtype`, `upcast_source`, `fused_cast`;
- in-place writes: `in_place`, `mutated_after`.

Index notation (views as renamed index letters, contractions read as one Σ Π) is in _index.py.
"""
from __future__ import annotations

import math
import operator
import weakref
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
    torch.Tensor.select: "select", torch.clamp: "clamp", torch.Tensor.clamp: "clamp", torch.clip: "clamp",
    torch.Tensor.clip: "clamp", torch.clamp_min: "clamp_min", torch.Tensor.clamp_min: "clamp_min",
    abs: "abs", operator.abs: "abs", torch.abs: "abs", torch.Tensor.abs: "abs",
    torch.amax: "amax", torch.Tensor.amax: "amax", torch.max: "max", torch.Tensor.max: "max",
    operator.floordiv: "floordiv", torch.floor_divide: "floordiv", torch.Tensor.floor_divide: "floordiv",
}
_METHOD_NAMES = {"__and__": "and", "logical_and": "and", "__or__": "or", "logical_or": "or", "logical_not": "not",
                 "__invert__": "not", "bitwise_not": "not", "truediv": "div", "true_divide": "div", "divide": "div",
                 "multiply": "mul", "broadcast_to": "expand", "expand_as": "expand", "greater_equal": "ge",
                 "less_equal": "le", "greater": "gt", "less": "lt", "swapaxes": "transpose", "swapdims": "transpose",
                 # operators on tensors recorded as method calls (e.g. `a == b` in transformers 5.17's packed mask)
                 "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
                 "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div", "__neg__": "neg",
                 "__pow__": "pow", "__matmul__": "matmul", "__abs__": "abs",
                 "__floordiv__": "floordiv"}
# `kind`: the coarsening, and the names it gives at all (the computations the contraction readers know)
_COARSE = {"view": "reshape", "bmm": "matmul", "not": "invert"}
_KINDS = frozenset({"matmul", "mul", "div", "add", "sub", "neg", "pow", "invert", "getitem", "einsum", "exp", "cumsum",
                    "sum", "tril", "triu", "masked_fill", "where", "cat", "softmax", "elu", "flatten", "unsqueeze",
                    "transpose", "permute", "ones_like", "reciprocal", "reshape", "pad", "repeat_interleave",
                    "zeros_like", "expand", "mT", "narrow", "zeros", "stack", "unbind", "select", "clamp",
                    "clamp_min"})
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


def is_zeros(node) -> bool:
    """node is zeros (torch.zeros, zeros_like, new_zeros, or a constant that evaluates to zeros)."""
    node = strip(node)
    if kind(node) in ("zeros", "zeros_like", "new_zeros"):
        return True
    value = evaluate_constant(node)
    return isinstance(value, torch.Tensor) and not value.any()


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


# ---------------------------------------------------------------------------- in-place writes

_OPERATOR_FUNCTIONS = {getattr(operator, n) for n in dir(operator) if not n.startswith("_")
                       and callable(getattr(operator, n))}
_OPERATOR_WRITES = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                    operator.ilshift, operator.irshift, operator.imatmul}


def in_place(node: fx.Node) -> bool:
    """Whether the call writes its first argument in place: an op whose name ends in one underscore (`x.add_(...)`,
    `index_copy_`) or an item assignment (`x[idx] = v`, which Dynamo records as `operator.setitem`)."""
    if node.op == "call_function" and node.target in _OPERATOR_FUNCTIONS:  # `and_`, `or_` write nothing
        return node.target in _OPERATOR_WRITES
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def storage_of(node: Any) -> int | None:
    """An id of the storage behind the node's example tensor (shared by its views and aliases), or None."""
    t = tensor(node)
    if t is None:
        return None
    try:
        return torch._C._storage_id(t)
    except (RuntimeError, TypeError, AttributeError):
        return None


_writes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> (its node count, writes)


def writes_by_storage(graph: fx.Graph) -> dict[int, list[fx.Node]]:
    """storage id -> the nodes of the graph that write that storage in place (through any view of it), in graph
    order; kept per graph until its node count changes (the matchers ask once per mask)."""
    count = len(graph.nodes)
    cached = _writes.get(graph)
    if cached is not None and cached[0] == count:
        return cached[1]
    writes: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op in ("call_function", "call_method") and n.args and isinstance(n.args[0], fx.Node) and in_place(n):
            sid = storage_of(n.args[0])
            if sid is not None:
                writes.setdefault(sid, []).append(n)
    _writes[graph] = (count, writes)
    return writes


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
