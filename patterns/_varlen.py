"""Run-time masks for the mask prover (patterns/_mask.py): the tensors HF builds per batch and the literals they
become.

* A padding mask: a graph input (up to views and casts), 2-D bool, read at [batch, key] (HF's `attention_mask`):
  the literal ("keep", mask, row, col).
* Packed-sequence ids: a 2-D integer cumsum along the sequence of a bool tensor (HF's `find_packed_sequence_indices`,
  `(diff(position_ids) != 1).cumsum(-1)`), so nondecreasing with each id one contiguous run; read at [batch, query]
  and [batch, key] and compared for equality: the literal ("same", ids, row, col, col2).
* A left-padding count: the number of leading False entries of a padding mask's rows,
  `(mask.cumsum(-1) == 0).sum(-1)`, read at [batch] (HF's Llama-4 mask counts its chunks from each row's first token).
  Its read is the Aff L_b of the pseudo-axis `leftpad_axis(mask)`, which only chunk ids may use:
  (j - L_b) // C == (i - L_b) // C.
* Position ids: a 2-D integer graph input. With packed sequences HF evaluates its causal and window rules on
  pos[b, query] and pos[b, key]; within one sequence the positions rise by exactly 1 (that is how the ids were made),
  so pos[b, x] = x + R with R one unknown offset per sequence (`run_axis`), which cancels between the two reads. Such
  a comparison holds only together with the same-sequence literal of the ids made from these positions, which
  `literals` checks.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tk_inductor.rewrite import example

from ._affine import Pred, run_axis
from ._fx import _CASTS, Keep, eq, known, number
from ._fx import arg as _arg
from ._fx import name as _name


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


def _segment_source(node) -> bool:
    """Whether `node` holds packed-sequence ids computed at run time: a 2-D integer cumsum along the sequence of a
    bool tensor (HF's `find_packed_sequence_indices`: `(diff(position_ids) != 1).cumsum(-1)`), so nondecreasing,
    each id one contiguous run."""
    ex = example(node) if isinstance(node, fx.Node) else None
    if not (isinstance(ex, torch.Tensor) and ex.dim() == 2 and not ex.is_floating_point() and ex.dtype != torch.bool):
        return False
    if _name(node) != "cumsum" or not isinstance(node.args[0], fx.Node):
        return False
    dim = number(_arg(node, 1, "dim"))
    src = example(node.args[0])
    return dim in (1, -1) and isinstance(src, torch.Tensor) and src.dtype == torch.bool


def _segment_positions(node) -> fx.Node | None:
    """The run-time position ids whose restarts made the sequence ids `node` (`cumsum(diff(pos) != 1)`: within one
    id the positions rise by exactly 1), as their graph input, or None."""
    ne = node.args[0]
    if _name(ne) != "ne" or len(ne.args) != 2 or number(ne.args[1]) != 1 or not isinstance(ne.args[0], fx.Node) \
            or _name(ne.args[0]) != "diff":
        return None
    diff = ne.args[0]
    if number(_arg(diff, 1, "n", 1)) != 1 or number(_arg(diff, 2, "dim", -1)) not in (1, -1):
        return None
    return _input_of(diff.args[0])


def _position_source(node) -> bool:
    """Whether `node` is a run-time 2-D integer tensor (a graph input up to views and casts): position ids."""
    ex = example(node) if isinstance(node, fx.Node) else None
    return (isinstance(ex, torch.Tensor) and ex.dim() == 2 and not ex.is_floating_point() and ex.dtype != torch.bool
            and _from_graph_input(node))


def _input_of(node):
    """The graph input a value views or casts (see _from_graph_input), else the node itself."""
    while isinstance(node, fx.Node) and node.op != "placeholder" and _from_graph_input(node):
        node = node.args[0]
    return node


def _padding_source(node) -> bool:
    """Whether `node` is a run-time 2-D bool mask (a graph input up to views and casts): HF's padding mask."""
    ex = example(node) if isinstance(node, fx.Node) else None
    return isinstance(ex, torch.Tensor) and ex.dtype == torch.bool and ex.dim() == 2 and _from_graph_input(node)


def leftpad_source(node) -> fx.Node | None:
    """The padding mask (see _padding_source) whose per-row count of leading False entries `node` is, HF's
    `(mask.cumsum(-1) == zeros_like(mask)).sum(-1)`, or None."""
    if not isinstance(node, fx.Node) or _name(node) != "sum" or not node.args \
            or number(_arg(node, 1, "dim")) not in (1, -1) or number(_arg(node, 2, "keepdim", False)):
        return None
    cmp = node.args[0]
    if _name(cmp) != "eq" or len(cmp.args) != 2:
        return None
    total, zero = cmp.args if _name(cmp.args[0]) == "cumsum" else cmp.args[::-1]
    if _name(total) != "cumsum" or number(_arg(total, 1, "dim")) not in (1, -1):
        return None
    mask = total.args[0]
    zero_like = _name(zero) == "zeros_like" and zero.args[0] is mask
    if not (zero_like or number(zero) == 0) or not _padding_source(mask):
        return None
    return mask


def leftpad_axis(mask) -> int:
    """The pseudo-axis (positive; the index's axes are negative) of the left-padding count of padding mask `mask`."""
    return id(mask)


def batch_read(row, node, B) -> bool:
    """Whether a run-time (B or 1, n) tensor is read at the scores' batch index (or at 0 where there is one entry)."""
    n = example(node).shape[0]
    return (row == (((-4, 1),), 0) and (eq(n, B) or eq(n, 1))) or (row == ((), 0) and (eq(B, 1) or eq(n, 1)))


def _one_block(chunk: int, forms, score_shape: tuple) -> bool:
    """Whether every form (coefs, c) over the scores' box takes its values inside one chunk [k·chunk, (k + 1)·chunk),
    the same for all: chunk ids compared there are always equal (Llama-4's chunked attention on a sequence no longer
    than a chunk)."""
    blocks = set()
    for coefs, c in forms:
        lo = hi = c
        for axis, k in coefs:
            size = number(score_shape[axis]) if -len(score_shape) <= axis < 0 else None
            if not isinstance(size, int) or not isinstance(c, int):
                return False
            lo, hi = lo + min(0, k * (size - 1)), hi + max(0, k * (size - 1))
        blocks |= {lo // chunk, hi // chunk}
    return len(blocks) == 1


def literals(allowed: Pred, score_shape: tuple) -> tuple:
    """(pad, segments, chunk, chunk_from_pad) of the allowed set's literals (MaskKind): the padding mask read at
    [batch, offset + key] inside its columns; the sequence ids compared at [batch, query] and [batch, key] over the
    whole sequence; the chunk size C of chunked attention's i // C == j // C (0: none, or equal everywhere on the box),
    and whether its positions count from each row's first unpadded key, (i - L_b) // C with L_b the padding mask's
    left padding (offset 0)."""
    pad = segments = None
    chunk, chunk_axis = 0, None
    runs = {lit[1] for lit in allowed.pads if lit[0] == "runs"}
    for lit in (lit for lit in allowed.pads if lit[0] == "block"):
        if _one_block(lit[1], lit[2:], score_shape):
            continue  # the chunk ids compared are equal everywhere on the box
        shifts = {axis for form in lit[2:] for axis, _ in form[0] if axis > 0}
        axis = next(iter(shifts), None)
        shift = ((axis, -1),) if axis is not None else ()  # (i - L_b) // C: the left-padding count's pseudo-axis
        want = [(((-2, 1),) + shift, 0), (((-1, 1),) + shift, 0)]
        if chunk or len(score_shape) < 2 or not eq(score_shape[-2], score_shape[-1]) or len(shifts) > 1 \
                or sorted(lit[2:]) != want:
            raise Keep(f"chunked attention (chunks of {lit[1]}) other than i // C == j // C over one sequence")
        chunk, chunk_axis = lit[1], axis
    for lit in (lit for lit in allowed.pads if lit[0] not in ("runs", "block")):
        if pad is not None and lit[0] == "keep" or segments is not None and lit[0] == "same":
            raise Keep("the mask combines several padding masks or sequence-id tensors")
        if len(score_shape) != 4:
            raise Keep("a run-time mask on scores that are not (B, H, N, M)")
        B, N, M = score_shape[0], score_shape[-2], score_shape[-1]
        node, row = lit[1], lit[2]
        ex = example(node)
        if not batch_read(row, node, B):
            raise Keep("a run-time mask is not read at the scores' batch index")
        if lit[0] == "keep":
            coefs, offset = lit[3]
            # Columns the graph cannot prove the mask has (its length and the cache's are separate symbols) are
            # checked when the adapter slices them, as eager's indexing checks them.
            if not (coefs == ((-1, 1),) or (coefs == () and eq(M, 1))) or offset < 0 \
                    or known(offset + example(M) > example(ex.shape[1])):
                raise Keep("the padding mask is not read at [batch, key + a constant offset] inside its columns")
            pad = (node, offset)
        else:
            if tuple(sorted((lit[3], lit[4]))) != ((((-2, 1),), 0), (((-1, 1),), 0)) or not (eq(N, M) and eq(N, ex.shape[1])):
                raise Keep("the sequence ids are not compared at [batch, query] and [batch, key] of one sequence")
            segments = node
    if runs and (segments is None or runs != {run_axis(_segment_positions(segments))}):
        raise Keep("position ids are compared without the packed-sequence ids made from them")
    if chunk and segments is not None:
        raise Keep("chunked attention over packed sequences")
    if chunk_axis is not None and (pad is None or pad[1] != 0 or leftpad_axis(pad[0]) != chunk_axis):
        raise Keep("chunks counted from the left padding of a mask other than the padding mask read at [batch, key]")
    return pad, segments, chunk, chunk_axis is not None
