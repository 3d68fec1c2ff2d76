"""The steps of an eager attention that are not its operands: the two products (`matmul`, `bmm`, GPT-2's
`baddbmm(_, q, kᵀ, beta=0)`, the two einsums), the softmax's dim and dtype, the dropout of the weights, and the
forward path from the scores to the softmax and on to the value product (patterns/attention.py)."""
from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from ._fx import arg as _arg
from ._fx import Keep, eq, number, rank, shape
from ._fx import name as _name

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
        return kind == "qk" and number(node.kwargs.get("beta", 1)) == 0 and len(node.args) == 3
    if name in _MATMULS:
        return len(node.args) == 2 and not node.kwargs
    return name == "einsum" and _einsum_kind(node) == kind


def _softmax_dim_ok(node: fx.Node) -> bool:
    nd = rank(node)
    dim = number(_arg(node, 1, "dim"))  # x.softmax(dim) and softmax(x, dim): args[1] either way
    return isinstance(dim, int) and nd > 0 and dim % nd == nd - 1


def _softmax_dtype(node: fx.Node):
    if node.op == "call_method":
        return _arg(node, 2, "dtype")
    if node.target is F.softmax:
        return _arg(node, 3, "dtype")
    return _arg(node, 2, "dtype")


def _same_scores(a: tuple, b: tuple) -> bool:
    """Same (N, M) in the last two dims and the same number of (batch, head) rows before them."""
    if len(a) < 2 or len(b) < 2 or not (eq(a[-1], b[-1]) and eq(a[-2], b[-2])):
        return False
    return eq(math.prod(a[:-2]), math.prod(b[:-2]))


def _path_to(start: fx.Node, is_end, depth: int) -> list[fx.Node] | None:
    """The first forward path [start, ..., end] within `depth` steps whose inner nodes keep the
    scores' shape and are not products (so one layer's output never reaches the next layer's softmax)."""
    want = shape(start) or ()
    frontier = [[start]]
    for _ in range(depth):
        nxt = []
        for path in frontier:
            for user in path[-1].users:
                if is_end(user, path[-1]):
                    return path + [user]
                s = shape(user) or ()
                if (user.op in ("call_function", "call_method") and _name(user) not in _MATMULS + ("baddbmm", "einsum", "sdpa")
                        and _same_scores(s, want)):
                    nxt.append(path + [user])
        frontier = nxt
    return None


def _dropout_p(node: fx.Node) -> float:
    """The probability a dropout node drops with (0 when not training)."""
    if node.target is torch.dropout:
        p, train = _arg(node, 1, "p"), _arg(node, 2, "train")
    else:
        p, train = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
    p, train = number(p), number(train) if train is not None else None
    if p is None or train is None:
        raise Keep("dropout with a non-constant probability or mode")
    if not 0 <= p < 1:
        raise Keep(f"dropout p={p}")
    return float(p) if train else 0.0
