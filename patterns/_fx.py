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


# ---------------------------------------------------------------------------- dtype casts

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
