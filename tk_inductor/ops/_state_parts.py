"""Scans with a state the SSD kernels do not hold, run as parts that they do.

The SSD's and simple GLA's kernels (csrc/kernels/ssd) keep a head's state, p × n, in one warpgroup's registers: they
take state sizes n of 16, 32, 64 or 128 and head dims p that are multiples of 64. Both scans are linear in the
state's columns. With B = [B₁ B₂] and C = [C₁ C₂] split by columns, the state h = [h₁ h₂] evolves block by block (the
decay is one scalar per head and token), and y = h C = h₁ C₁ + h₂ C₂. So a larger state runs as column blocks of at
most 128, each zero-padded to a size the kernels take (a zero column of B and C keeps a zero state column and adds
nothing): the outputs are summed and the states concatenated.

The gradients split the same way. Those of the per-block inputs (B, C, the states' blocks) are concatenated, those of
the inputs every block reads (x, dt, A) are summed, and a term outside the state (the SSD's D·x) goes to one block
only. A head dim that is not a multiple of 64 is zero-padded: zero rows of the state, sliced off the outputs. Each
block costs a pass of the kernels over the inputs every block reads (for n 256, two passes over x and y).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# What the kernels hold (csrc/kernels/ssd): state sizes, and the head-dim tile.
STATE_SIZES, P_TILE = (16, 32, 64, 128), 64
# The head dims the ops take to the kernels: padding a multiple of 32 to one of 64 at most doubles the work.
P_MULTIPLE = 32


@dataclass(frozen=True)
class Axes:
    """Where a tensor has the state-size axis (n) and the head-dim axis (p), if it has them."""
    n: int | None = None
    p: int | None = None


@dataclass(frozen=True)
class Plan:
    """How a raw op's arguments are cut and its outputs assembled.

    `cut`: argument index → its axes; `once`: arguments only the first block gets (None for the others);
    `outs`: per output, ("sum", axes) (summed over the blocks), ("cat", axes) (concatenated along n) or
    ("first", axes) (the first block's); each with p sliced back."""
    cut: dict
    once: tuple = ()
    outs: tuple = ()


def supports(n, p, n_name: str = "state size", p_name: str = "head dim") -> str | None:
    """None if the kernels run state size n and head dim p (directly or in parts), else why not. A symbolic size
    (dynamic=True) is specialised to its value, as a comparison with the kernels' sizes would."""
    n, p = (int(v) if isinstance(v, torch.SymInt) else v for v in (n, p))
    if not isinstance(n, int) or n <= 0:
        return f"{n_name} {n}"
    if not isinstance(p, int) or p <= 0 or p % P_MULTIPLE:
        return f"{p_name} {p} (the SSD kernels take multiples of {P_MULTIPLE})"
    return None


def blocks(n: int) -> list[tuple[int, int, int]]:
    """[(lo, hi, size)]: n's columns in blocks of at most 128, each run at the smallest size the kernels take that
    holds it."""
    top = max(STATE_SIZES)
    return [(lo, min(n, lo + top), min(s for s in STATE_SIZES if s >= min(n, lo + top) - lo))
            for lo in range(0, n, top)]


def _pad(t: torch.Tensor, axis: int, extra: int) -> torch.Tensor:
    axis %= t.dim()
    return torch.nn.functional.pad(t, [0, 0] * (t.dim() - 1 - axis) + [0, extra])


def _absent(t: torch.Tensor) -> bool:
    """The raw ops return an empty 1-D tensor for a gradient they do not have (no D, no initial state)."""
    return t.dim() == 1 and t.numel() == 0


def run(raw, args: tuple, n: int, p: int, plan: Plan):
    """raw(*args), with the state size n cut into blocks and the head dim p padded where the kernels need it."""
    p_pad = -(-p // P_TILE) * P_TILE
    parts = blocks(n)
    if p_pad == p and len(parts) == 1 and parts[0][2] == n:
        return raw(*args)
    args = list(args)
    if p_pad != p:
        for i, axes in plan.cut.items():
            if axes.p is not None and args[i] is not None:
                args[i] = _pad(args[i], axes.p, p_pad - p)
    results = []
    for k, (lo, hi, size) in enumerate(parts):
        block = list(args)
        for i, axes in plan.cut.items():
            if axes.n is not None and block[i] is not None:
                block[i] = block[i].narrow(axes.n, lo, hi - lo)
                if size > hi - lo:
                    block[i] = _pad(block[i], axes.n, size - (hi - lo))
        if k:
            for i in plan.once:
                block[i] = None
        results.append(raw(*block))
    outs = []
    for j, (how, axes) in enumerate(plan.outs):
        got = [r[j] for r in results]
        if how == "first" or _absent(got[0]):
            out = got[0]
        elif how == "sum":
            total = got[0].float()  # the first block's own output (fp32 already: added into in place)
            for g in got[1:]:
                total += g
            out = total.to(got[0].dtype)
        else:
            out = torch.cat([g.narrow(axes.n, 0, hi - lo) for g, (lo, hi, _) in zip(got, parts)], dim=axes.n)
        if axes.p is not None and p_pad != p and not _absent(out):
            out = out.narrow(axes.p, 0, p)
        outs.append(out.contiguous())
    return tuple(outs)
