"""Masks written in place that are still a packed-sequence structure: Pixtral's vision encoder packs the patches of
several images in one sequence and builds its mask as a full fill with each image's diagonal block written visible
(`m = full((N, N), min); m[s:e, s:e] = 0`). The mask analysis (patterns/_mask.py) keeps any tensor written in place;
this one case is read structurally before it, as static packed-sequence ids (tk::attention_varlen)."""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from tk_inductor.rewrite import example

from ._fx import arg as _arg
from ._fx import name as _name, number, shape, storage_of, writes_by_storage
from ._mask import _NEG_BIG

_UNIT_VIEWS = ("getitem", "expand", "unsqueeze", "view", "reshape")


def static_blocks(mask: fx.Node, N) -> tuple[int, ...] | None:
    """A block-diagonal (N, N) mask written in place: `m = full((N, N), fill)` (fill False, or -inf or a value at or
    below _NEG_BIG to add), then `m[s:e, s:e] = True / 0` for blocks [s, e) that tile [0, N) in order, read through
    views (`m[None, None]`, expand): each query sees the keys of its own block (Pixtral's image blocks, packed in one
    sequence). The block lengths, or None for any other mask."""
    if not isinstance(N, int):
        return None
    base = mask
    while _name(base) in _UNIT_VIEWS and isinstance(base.args[0], fx.Node):
        if tuple((shape(base) or ())[-2:]) != (N, N) or (_name(base) == "getitem" and not all(
                i is None or i == slice(None) for i in (base.args[1] if isinstance(base.args[1], tuple)
                                                         else (base.args[1],)))):
            return None  # only views that add unit or broadcast dims in front of (N, N)
        base = base.args[0]
    if _name(base) != "full" or tuple(shape(base) or ()) != (N, N):
        return None
    raw, additive = _arg(base, 1, "fill_value"), example(base).dtype != torch.bool
    fill = number(raw) if additive else None
    if (additive and (fill is None or not (fill == -math.inf or fill <= _NEG_BIG))) or (not additive and raw is not False):
        return None
    blocks, writers = [], writes_by_storage(base.graph).get(storage_of(base))
    if not writers or any(w.args[0] is not base or w.target is not operator.setitem for w in writers):
        return None  # every write to its storage is an item assignment of the full tensor itself
    for u in base.users:
        if u.op == "call_function" and u.target is operator.setitem:
            idx, value = u.args[1], u.args[2]
            if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] == idx[1] and isinstance(idx[0], slice)
                    and idx[0].step in (None, 1) and isinstance(idx[0].stop, int)
                    and (number(value) == 0 if additive else value is True)):
                return None
            blocks.append((idx[0].start or 0, idx[0].stop))
        elif _name(u) not in _UNIT_VIEWS:
            return None
    order = {n: i for i, n in enumerate(base.graph.nodes)}
    reads = [order[u] for u in base.users if u.target is not operator.setitem]
    if max(order[u] for u in base.users if u.target is operator.setitem) > min(reads):
        return None  # a read before a write
    blocks.sort()
    if not blocks or blocks[0][0] != 0 or blocks[-1][1] != N or any(
            b[0] != a[1] or b[1] <= b[0] for a, b in zip(blocks, blocks[1:])) or blocks[0][1] <= 0:
        return None
    return tuple(e - b for b, e in blocks)
