"""Reading decay matrices: the causal matrix of exp(G_i − G_j) for j ≤ i (zero above the diagonal), G the inclusive
cumulative sum over the tokens of a per-token log decay a, which the Mamba-2 SSD (patterns/ssd.py) and gated linear
attention (patterns/linear_attention.py, simple GLA) multiply their scores by. `segsum_input` reads the spellings that
mask with -inf before the exp (Mamba's segsum); `decay_matrix` also those that mask the exp's result (FLA's naive
parallel forms: `(G_i − G_j).tril().exp().tril()`).
"""
from __future__ import annotations

from ._fx import arg, eq, kind, scalar, shape, shapes_eq, strip
from ._index import peel_to
from ._mask import triangle


class NoMatch(Exception):
    """Not the form looked for; the message says which part failed."""


def need(cond, why: str):
    if not cond:
        raise NoMatch(why)


def _difference_of_cumsum(inner, rank: int, T):
    """cs[..., :, None] - cs[..., None, :] with cs = cumsum(a, -1) (rank: the difference's) -> a."""
    letters = "abcdefgh"[:rank - 1]
    rows = peel_to(inner.args[0], letters + "z", letters)
    cols = peel_to(inner.args[1], letters[:-1] + "z" + letters[-1], letters)
    need(rows is not None and strip(rows) is strip(cols), "segsum: not cs[..., :, None] - cs[..., None, :]")
    cs = strip(rows)
    need(kind(cs) == "cumsum" and arg(cs, 1, "dim") % (rank - 1) == rank - 2 and eq(shape(cs)[-1], T),
         "segsum: no cumsum")
    return strip(cs.args[0])


def segsum_input(node):
    """exp(segsum(a)) -> a (the (..., T) tensor), in either spelling of segsum: the masked cumsum of a[..., None]
    expanded over T columns (HF, mamba_ssm), or the difference of a's cumsum with itself, cs[..., :, None] -
    cs[..., None, :] (the Mamba-2 blog's first listing); both masked to -inf above the diagonal."""
    node = strip(node)
    need(kind(node) == "exp", "decay is not exp(segsum)")
    fill2 = strip(node.args[0])
    need(kind(fill2) == "masked_fill" and scalar(arg(fill2, 2, "value")) == float("-inf"), "segsum: no -inf mask")
    inner = strip(fill2.args[0])
    rank = len(shape(inner) or ())
    need(rank >= 2, "segsum: rank")
    T = shape(inner)[-1]
    need(triangle(fill2.args[1], (T, T), 0, negated=True), "segsum: masks not triangular")
    letters = "abcdefgh"[:rank - 1]
    if kind(inner) == "sub":  # cs[..., :, None] - cs[..., None, :], cs = cumsum(a, -1)
        return _difference_of_cumsum(inner, rank, T)
    cs = inner
    need(kind(cs) == "cumsum" and arg(cs, 1, "dim") is not None, "segsum: no cumsum")
    fill1 = strip(cs.args[0])
    need(kind(fill1) == "masked_fill" and scalar(arg(fill1, 2, "value")) == 0.0, "segsum: no zero mask")
    expanded = strip(fill1.args[0])
    need(kind(expanded) == "expand", "segsum: input not expanded")
    need(arg(cs, 1, "dim") % rank == rank - 2, "segsum: cumsum over the wrong dim")
    src = peel_to(expanded.args[0], letters + "z", letters)
    need(src is not None and eq(shape(src)[-1], T) and shapes_eq(shape(expanded)[:-1], shape(src)),
          "segsum: not a[..., None].expand(..., T)")
    need(triangle(fill1.args[1], (T, T), -1, negated=True), "segsum: masks not triangular")
    return strip(src)


def decay_matrix(node, causal):
    """node == the causal decay matrix of a per-token log decay a (module docstring) -> a, the (..., T) tensor whose
    last dim the cumsum runs over; NoMatch otherwise. `causal(x)` returns the matrix that x masks to its lower
    triangle (zero above the diagonal), or None (patterns/linear_attention.py `_causal`). Spellings: exp of the
    difference masked to -inf above the diagonal before the exp (segsum_input), or any exp(Δ), exp(tril(Δ)),
    exp(Δ masked to 0 or -inf) made causal after the exp, Δ = cs[..., :, None] - cs[..., None, :]."""
    node = strip(node)
    inner = causal(node)
    if inner is None:
        return segsum_input(node)
    e = strip(inner)
    need(kind(e) == "exp", "decay is not exp(Δ)")
    d = strip(e.args[0])
    if kind(d) == "masked_fill" and scalar(arg(d, 2, "value")) == float("-inf"):
        T = (shape(d) or (0,))[-1]
        need(triangle(d.args[1], (T, T), 0, negated=True), "decay: the -inf mask is not the upper triangle")
        d = strip(d.args[0])
    else:
        d = strip(causal(d) or d)  # exp(0) = 1 above the diagonal, then masked after the exp
    rank = len(shape(d) or ())
    need(kind(d) == "sub" and rank >= 2 and eq(shape(d)[-1], shape(d)[-2]), "decay: no difference of cumsums")
    return _difference_of_cumsum(d, rank, shape(d)[-1])
