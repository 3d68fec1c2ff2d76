"""Attention sinks (gpt-oss): one more logit per row concatenated to the scores before the softmax, whose column is
dropped after it. softmax([s, sink]) without the sink's column is softmax(s)·σ(lse − sink), lse = logsumexp(s), so
tk::attention's (o, lse) and a rescale compute it (ops/attention.py `attention_sink_adapter`). The readers here find
that cat, the slice that drops its column, and the row-max shift eager code subtracts before a softmax (softmax is
invariant to it)."""
from __future__ import annotations

import torch.fx as fx

from ._fx import arg, eq, name, number, shape


def _last_dim(node: fx.Node, dim) -> bool:
    d = number(dim)
    return d is not None and (d == -1 or d == len(shape(node) or ()) - 1)


def is_sink_cat(u: fx.Node, prev: fx.Node) -> bool:
    """u = cat([prev, t], dim=-1) with t one logit per row (last dim 1, prev's other dims)."""
    if name(u) != "cat":
        return False
    parts = arg(u, 0, "tensors")
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or parts[0] is not prev:
        return False
    s, t = shape(prev), shape(parts[1])
    return (_last_dim(u, arg(u, 1, "dim", 0)) and s is not None and t is not None and len(s) == len(t)
            and eq(t[-1], 1) and all(eq(a, b) for a, b in zip(s[:-1], t[:-1])))


def sink_operand(cat: fx.Node) -> fx.Node:
    return arg(cat, 0, "tensors")[1]


def row_max(n: fx.Node, of: fx.Node) -> list[fx.Node] | None:
    """The nodes computing `of`'s row max over the last dim, kept (amax, or max(...).values), ending at n; else
    None."""
    chain = [n]
    if name(n) == "getitem" and n.args[1] == 0 and isinstance(n.args[0], fx.Node):
        n = n.args[0]
        chain.append(n)
        if name(n) != "max":
            return None
    elif name(n) != "amax":
        return None
    if not n.args or n.args[0] is not of or not _last_dim(of, arg(n, 1, "dim")) or not number(arg(n, 2, "keepdim")):
        return None
    return chain


def is_row_max_shift(n: fx.Node, prev: fx.Node) -> list[fx.Node] | None:
    """n = prev - rowmax(prev) (the stable softmax's shift): the row max's nodes, else None."""
    if name(n) != "sub" or len(n.args) != 2 or n.args[0] is not prev or not isinstance(n.args[1], fx.Node):
        return None
    return row_max(n.args[1], prev)


def drops_sink(u: fx.Node, probs: fx.Node) -> bool:
    """u = probs[..., :-1] (or with every leading dim sliced whole): the sink's column dropped."""
    if name(u) != "getitem" or u.args[0] is not probs:
        return False
    index = u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],)
    last = index[-1] if index else None
    whole = all(i is Ellipsis or i == slice(None) for i in index[:-1])
    rank_ok = Ellipsis in index or len(index) == len(shape(probs) or ())
    return (whole and rank_ok and isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1)
            and number(last.stop) == -1)
