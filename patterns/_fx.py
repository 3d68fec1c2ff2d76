"""Small graph-reading helpers shared by the matchers."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from tk_inductor.rewrite import example


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
