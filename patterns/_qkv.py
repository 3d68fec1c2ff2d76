"""The q, k and v of an attention pattern: the tensors the op reads, found by walking back through what does not
change their values (views, `contiguous`, casts to the dtype they have, a transpose of the last two dims, scaling by a
positive constant, HF's `repeat_kv` / `repeat_interleave` over heads, a `cat` with empty caches, the merge of batch
and heads into one dim), with what was looked through recorded on the operand (patterns/attention.py)."""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from tk_inductor.rewrite import Cast, example

from ._fx import arg as _arg
from ._fx import _CASTS, eq, known, number, rank, shape
from ._fx import name as _name


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
    nd = rank(node)
    name = _name(node)
    if name == "mT":
        return True
    if name == "transpose":
        dims = {int(number(d)) % nd for d in node.args[1:3]} if len(node.args) >= 3 else set()
        return dims == {nd - 2, nd - 1}
    if name == "permute":
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        dims = [int(number(d)) % nd for d in dims]
        return dims == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def _repeat_kv_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, r) if node is x (B, H, M, D) with every head repeated r times consecutively."""
    name = _name(node)
    if name == "repeat_interleave":
        reps, dim = number(_arg(node, 1, "repeats")), _arg(node, 2, "dim")
        src = node.args[0]
        if isinstance(reps, int) and dim is not None and rank(src) == 4 and int(number(dim)) % 4 == 1:
            return src, reps
        return None
    if name not in ("reshape", "view", "flatten"):
        return None
    exp = node.args[0]
    out = shape(node) or ()
    if _name(exp) != "expand" or rank(exp) != 5 or len(out) != 4:
        return None
    B, H, r, M, D = shape(exp) or ()
    if not (eq(out[0], B) and eq(out[1], H * r) and eq(out[2], M) and eq(out[3], D)):
        return None
    unsq = exp.args[0]
    us = shape(unsq) or ()
    if len(us) != 5 or not eq(us[2], 1):
        return None
    src = None
    if _name(unsq) == "unsqueeze" and int(number(_arg(unsq, 1, "dim"))) % 5 == 2:
        src = unsq.args[0]
    elif _name(unsq) == "getitem":
        index = unsq.args[1]
        if (isinstance(index, tuple) and len(index) >= 3 and index[2] is None
                and all(isinstance(i, slice) and i == slice(None) for i in index[:2] + index[3:])):
            src = unsq.args[0]
    if src is None or rank(src) != 4:
        return None
    return src, number(r) if isinstance(number(r), int) else None


def _positive_const(x):
    """x as a positive finite number, or None. A symbolic float (`dynamic=True` passes float attributes such as a
    scaling or a softcap as graph inputs) is specialised: its value is guarded, so another value recompiles."""
    v = number(x) if not isinstance(x, fx.Node) or not isinstance(example(x), torch.Tensor) else None
    if v is None and isinstance(example(x), torch.SymFloat):
        v = float(example(x))
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
            s_in, s_out = shape(src) or (), shape(n) or ()
            if len(s_in) == 4 and len(s_out) == 3 and eq(s_out[0], s_in[0] * s_in[1]) \
                    and eq(s_out[1], s_in[2]) and eq(s_out[2], s_in[3]):
                op.node, op.merged = src, True
            elif len(s_in) == len(s_out) and all(eq(a, b) for a, b in zip(s_in, s_out)):
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
                                           and known(example(t).numel() == 0))]
    if len(nonempty) != 1 or not isinstance(nonempty[0], fx.Node):
        return None
    x = nonempty[0]
    ex, ey = example(x), example(node)
    if not isinstance(ex, torch.Tensor) or ex.dtype != ey.dtype or len(ex.shape) != len(ey.shape) \
            or not all(eq(a, b) for a, b in zip(ex.shape, ey.shape)):
        return None
    return x
