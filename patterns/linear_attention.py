"""Match causal linear attention in a Dynamo (torch-IR) graph -> `tk::linear_attention`.

Spellings recognised, on q/k/v held heads-first (B, H, N, d), the op's layout, or tokens-first (B, N, H, d), as FLA
and many research repos hold them (the op then reads transposed views and its output goes back transposed; the
scores are (B, H, N, M) either way):
- quadratic: `(φq @ φkᵀ)` (matmul/einsum, optionally scaled) made causal by `torch.tril`,
  `masked_fill(~tril, 0)`, `* tril_mask` or `where(tril, A, 0)` — the mask must be built in the
  graph from constants (ones/tril/triu/arange...) so that it can be evaluated and proven lower-
  triangular, or, for a symbolic length, be literally `[~]tril(ones(N, N))` — then `@ v`.
- state/cumsum: `kv = cumsum(φk ⊗ v, dim=N)` (einsum or broadcast product), `o = φq · kv`
  (einsum or broadcast product + sum).
- chunked (unnormalised): the tokens in chunks, `o = φq S + ((φq φkᵀ) ∘ causal) v` with S the exclusive prefix of
  the chunks' φkᵀ v, merged back (FLA's naive_chunk_linear_attn; patterns/_chunked.py).
- the Taylor kernel written on the scores, `1 + s + s²/2` with `s = (q·scale) kᵀ` (FLA's
  naive_parallel_based).
- gated (simple GLA, -> `tk::simple_gla`): `((q kᵀ) ∘ D) v` with D the causal decay matrix exp(G_i − G_j) of a
  per-token log decay (patterns/_gated.py).
- optional normaliser: `o / (den + eps)` or `o * (1 / (den + eps))`, with `den` the row sum of the
  same masked scores or `φq · cumsum(φk)` of the same feature-mapped tensors (Based's spelling).
Feature maps: Based `TaylorExp` (`cat([1, x/d^¼, flatten(x⊗x)/(√2·√d)])`, ones as `x[..., :1]**0`
or `ones_like`), Hedgehog (`cat(softmax(xW), softmax(-xW))`, W per head via einsum on heads-first x, or shared via
matmul; a bias constant along the softmax dim and a clamp of the features at 1e-9 or less, LoLCATs-style, are read
as none: such a bias then gets no gradient, where eager's is zero up to rounding), `elu(x) + 1`. Anything else is passed as already-mapped features with "identity", which
is exactly equal (only slower when the features are wide).
FLA's HedgehogFeatureMap (one softmax over both halves, with bias) and FLA's current
TaylorFeatureMap (upper-triangle gather) are not the op's maps: they go in as "identity".
Kept with a reason: masked scores whose mask is not provably causal (an input, a band, triu...).
Not matched at all: scores without a mask, different q/k lengths, in-place masking (`masked_fill_`) of scores
that something else reads, a python-float scale that Dynamo made symbolic.

The graph-reading vocabulary (kind, eq, ...) is patterns/_fx.py's, contraction and unify patterns/_index.py's.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.fx as fx

from tk_inductor.ops import linear_attention as _ops  # noqa: F401  (registers torch.ops.tk.linear_attention)
from tk_inductor import config
from tk_inductor.rewrite import Match, Transpose, example

from ._fx import (arg, close, dtype, eq, evaluate_constant, is_tensor, kind, needs_grad, rank, scalar, scaled, shape,
                  shapes_eq, strip)
from ._chunked import chunked_form
from ._gated import match as gated
from ._index import LETTERS, Contraction, contraction, heads_first, peel_to, unify
from ._mask import triangle

FAMILY = "linear_attention"

# ============================================================================ feature maps

def _ones_column(node, x) -> bool:
    """`x[..., :1] ** 0`, `ones_like(x[..., :1])`, `torch.ones(..., 1)`-like: all ones, last dim 1."""
    s = shape(node)
    if s is None or not eq(s[-1], 1) or not shapes_eq(s[:-1], shape(x)[:-1]):
        return False
    node = strip(node)
    k = kind(node)
    if k == "pow" and scalar(node.args[1]) == 0.0 and is_tensor(node.args[0]):
        return True  # x**0 == 1 for every x (also inf/nan)
    if k == "ones_like" or kind(node) == "new_ones":
        return True
    value = evaluate_constant(node)
    return isinstance(value, torch.Tensor) and bool((value == 1).all())


def _outer_flat(node):
    """flatten(x.unsqueeze(-1) * x.unsqueeze(-2), -2) (or einsum '...i,...j->...ij'): x."""
    node = strip(node)
    if kind(node) == "flatten":
        start = arg(node, 1, "start_dim", 0)
        end = arg(node, 2, "end_dim", -1)
        rank = len(shape(node.args[0]) or ())
        if start % max(rank, 1) != rank - 2 or end % max(rank, 1) != rank - 1:
            return None
        c = contraction(node.args[0], inline=False)
        if c is None or c.scale != 1.0:
            return None
        batch = LETTERS[:rank - 2]
        b = unify(c, [("x", batch + "y"), ("x", batch + "z")], batch + "yz")
        return b["x"] if b is not None else None
    return None


def _taylor(node):
    """Based's TaylorExp: cat([1, x/d^¼, flatten(x⊗x)/(√2·√d)], -1) -> x."""
    parts = arg(node, 0, "tensors")
    dim = arg(node, 1, "dim", 0)
    rank = len(shape(node) or ())
    if not isinstance(parts, (list, tuple)) or len(parts) != 3 or rank == 0 or dim % rank != rank - 1:
        return None
    lin, c1 = scaled(parts[1])
    d = shape(lin)[-1] if shape(lin) else 0
    quad, c2 = scaled(parts[2])
    if not d or not close(c1, d ** -0.25) or not close(c2, 1 / (math.sqrt(2) * math.sqrt(d))):
        return None
    if _outer_flat(quad) is not lin or not _ones_column(parts[0], lin):
        return None
    return lin


def _softmax_last(node):
    node = strip(node)
    if kind(node) != "softmax" or node.kwargs.get("dtype") is not None:
        return None
    dim = arg(node, 1, "dim")
    rank = len(shape(node) or ())
    if dim is None or rank == 0 or dim % rank != rank - 1 or (len(node.args) > 2 and node.args[2] is not None):
        return None
    return node.args[0]


# A clamp from below of the features at most this small is read as no clamp: LoLCATs-style Hedgehog maps guard their
# features with `.clamp(min=1e-12)`, which moves a feature only where it is below the bound, by less than the bound
# (each softmax half sums to 1, so the features that matter are near 1/f).
NEGLIGIBLE_CLAMP = 1e-9


def _unclamped(node):
    """node without a `clamp(min=m)` / `clamp_min(m)` of 0 <= m <= NEGLIGIBLE_CLAMP (and no max)."""
    node = strip(node)
    k = kind(node)
    if k == "clamp" and arg(node, 2, "max") is None:
        low = scalar(arg(node, 1, "min"))
    elif k == "clamp_min":
        low = scalar(arg(node, 1, "min"))
    else:
        return node
    return strip(node.args[0]) if low is not None and 0.0 <= low <= NEGLIGIBLE_CLAMP else node


def _shift_free(z):
    """z less an added term constant along its last dim (a python scalar, or a tensor whose last size is 1: a
    per-head bias), which no softmax over the last dim sees."""
    z = strip(z)
    if kind(z) == "add" and not z.kwargs and len(z.args) == 2:
        for a, b in ((z.args[0], z.args[1]), (z.args[1], z.args[0])):
            if is_tensor(a) and (scalar(b) is not None or (is_tensor(b) and shape(b) is not None and len(shape(b)) >= 1
                                                           and eq(shape(b)[-1], 1))):
                return strip(a)
    return z


def _hedgehog(node):
    """cat([softmax(z), softmax(-z)], -1), z = x W (per head einsum or shared matmul) plus any term constant along
    the softmax's dim -> (x, W)."""
    parts = arg(node, 0, "tensors")
    dim = arg(node, 1, "dim", 0)
    rank = len(shape(node) or ())
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or rank != 4 or dim % rank != rank - 1:
        return None
    z = _softmax_last(parts[0])
    neg = _softmax_last(parts[1])
    if z is None or neg is None:
        return None
    base, factor = scaled(neg)
    if strip(base) is not strip(z) or factor != -1.0:
        return None
    z = _shift_free(z)
    if kind(z) == "matmul" and shape(z.args[1]) is not None and len(shape(z.args[1])) == 2:
        return z.args[0], z.args[1]
    c = contraction(z, inline=False)
    if c is not None and len(c.factors) == 2 and c.scale == 1.0:
        for xi, wi in ((0, 1), (1, 0)):
            b = unify(Contraction([c.factors[xi], c.factors[wi]], c.out, [c.chains[xi], c.chains[wi]]),
                      [("x", "bhnd"), ("w", "hdf")], "bhnf")
            if b is not None:
                return b["x"], b["w"]
    return None


def feature_map(node):
    """(name, x, weight) such that node == φ_name(x); ("identity", node, None) otherwise."""
    node = strip(node)
    k = kind(node)
    if k == "add":
        a, b = node.args[0], node.args[1]
        elu, one = (a, b) if is_tensor(a) else (b, a)
        elu = strip(elu)
        if scalar(one) == 1.0 and kind(elu) == "elu" and scalar(arg(elu, 1, "alpha", 1.0)) == 1.0 \
                and not arg(elu, 2, "inplace", False):
            return "elu1", elu.args[0], None
    if k == "cat":
        x = _taylor(node)
        if x is not None:
            return "based", x, None
    unclamped = _unclamped(node)
    hh = _hedgehog(unclamped) if kind(unclamped) == "cat" else None
    if hh is not None:
        return "hedgehog", hh[0], hh[1]
    return "identity", node, None


# ============================================================================ the matcher

# q, k and v are read heads-first, (B, H, N, d) as the op takes them, or tokens-first, (B, N, H, d) as FLA and many
# research repos hold them (the op then reads transposed views, and its output goes back transposed). Templates are
# written heads-first over b, h, n (queries) or m (keys), d / e (features / values); the scores stay (B, H, N, M).
LAYOUTS = ("bhnd", "bnhd")


def _lay(letters: str, layout: str) -> str:
    """The heads-first template `letters` in `layout` (swaps the head and token letters)."""
    return letters if layout == "bhnd" else letters[0] + letters[2] + letters[1] + letters[3:]

def _causal(node):
    """The scores A if node is A with the strictly-upper triangle zeroed (provably: patterns/_mask.py), else None."""
    node = strip(node)
    k = kind(node)
    N = (shape(node) or (0, 0))[-1]
    if rank(node) < 2 or not eq(shape(node)[-2], N):
        return None
    box = shape(node)
    if k == "tril" and arg(node, 1, "diagonal", 0) == 0:
        return node.args[0]
    if k == "masked_fill" and scalar(arg(node, 2, "value")) == 0.0 and triangle(node.args[1], box, 0, negated=True):
        return node.args[0]
    if _fresh_masked_fill_(node) and scalar(arg(node, 2, "value")) == 0.0 \
            and triangle(node.args[1], box, 0, negated=True):
        return node.args[0]
    if k == "mul" and is_tensor(node.args[0]) and is_tensor(node.args[1]):
        for a, m in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if shapes_eq(shape(a), shape(node)) and triangle(m, box):
                return a
    if k == "where" and len(node.args) == 3 and scalar(node.args[2]) == 0.0 and triangle(node.args[0], box):
        return node.args[1]
    return None


def _fresh_masked_fill_(node) -> bool:
    """`A.masked_fill_(mask, value)` on scores A that nothing else reads (FLA's naive spellings): the same value as
    the out-of-place fill."""
    return node.op == "call_method" and node.target == "masked_fill_" and is_tensor(node.args[0]) \
        and len(node.args[0].users) == 1 and kind(node.args[0]) in ("matmul", "einsum")


def _scores(A):
    """A == scale * (fq · fk) over the last dims: (fq, fk, scale, layout) with q-side/k-side scalars folded."""
    base, c = scaled(A)
    con = contraction(base, inline=False)
    for lay in LAYOUTS:
        b = unify(con, [("q", _lay("bhnd", lay)), ("k", _lay("bhmd", lay))], "bhnm") if con is not None else None
        if b is None:
            continue
        q, cq = scaled(b["q"])
        k, ck = scaled(b["k"])
        if shape(q) is None or len(shape(q)) != 4 or not shapes_eq(shape(q), shape(k)):
            return None
        return q, k, c * cq * ck * con.scale, lay
    return None


def _taylor_scores(A):
    """1 + s + s²/2 in any order of the sum: s."""
    terms = []

    def collect(n, sign=1.0):
        n = strip(n)
        if kind(n) == "add" and not n.kwargs:
            collect(n.args[0], sign), collect(n.args[1], sign)
        elif kind(n) == "sub" and not n.kwargs:
            collect(n.args[0], sign), collect(n.args[1], -sign)
        else:
            terms.append((n, sign))

    collect(A)
    const, linear, square = 0.0, [], []
    for t, sign in terms:
        if scalar(t) is not None:
            const += sign * scalar(t)
            continue
        base, c = scaled(t)
        base = strip(base)
        if kind(base) == "pow" and scalar(base.args[1]) == 2.0:
            square.append((strip(base.args[0]), sign * c))
        elif kind(base) == "mul" and strip(base.args[0]) is strip(base.args[1]) and is_tensor(base.args[0]):
            square.append((strip(base.args[0]), sign * c))
        else:
            linear.append((base, sign * c))
    if const != 1.0 or len(linear) != 1 or len(square) != 1:
        return None
    (s, c1), (s2, c2) = linear[0], square[0]
    if s is not s2 or c1 != 1.0 or not close(c2, 0.5):
        return None
    return s


def _times_v(node):
    """node = M v over the keys (matmul or einsum; M the (B, H, N, M) scores): (M, v, the layout of v and node, the
    product's scalar factor), or None."""
    c = contraction(node, inline=False)
    for lay in LAYOUTS if c is not None else ():
        b = unify(c, [("m", "bhnm"), ("v", _lay("bhme", lay))], _lay("bhne", lay))
        if b is not None:
            return b["m"], b["v"], lay, c.scale
    return None


def _numerator_quadratic(node):
    """o = M v with M causal-masked scores: (M, A, v, the layout of v and o)."""
    mv = _times_v(node)
    if mv is None or mv[3] != 1.0:  # (M·s) v with M's row sum as denominator: not the op
        return None
    M, v, lay, _ = mv
    A = _causal(M)
    if shape(v) is None or len(shape(v)) != 4:
        return None
    if A is None:
        masked = _masked_scores(M)
        if masked is not None and _scores(masked) is not None:
            raise _Kept("score mask not provably causal (a graph input, a band, an upper triangle, ...)")
        return None
    return M, A, v, lay


class _Kept(Exception):
    """Recognised as (masked) linear attention, but not provably the op."""


def _masked_scores(node):
    """The scores under some mask (tril/triu with any diagonal, masked_fill, where, * mask)."""
    node = strip(node)
    k = kind(node)
    if k in ("tril", "triu"):
        return node.args[0]
    if k == "masked_fill":
        return node.args[0]
    if k == "where" and len(node.args) == 3:
        return node.args[1] if scalar(node.args[2]) == 0.0 else None
    if k == "mul" and is_tensor(node.args[0]) and is_tensor(node.args[1]):
        return node.args[0] if shapes_eq(shape(node.args[0]), shape(node)) else node.args[1]
    return None


def _numerator_state(node):
    """o = scale · φq · cumsum(φk ⊗ v) (einsum or broadcast), over the tokens: (fq, fk, v, scale, layout)."""
    c = contraction(node, inline=False)
    for lay in LAYOUTS if c is not None else ():
        b = unify(c, [("q", _lay("bhnd", lay)), ("kv", _lay("bhnde", lay))], _lay("bhne", lay))
        if b is None:
            continue
        kv = strip(b["kv"])  # (an elementwise-batched contraction unifies in both layouts: the cumsum's dim decides)
        if kind(kv) != "cumsum" or arg(kv, 1, "dim") % 5 != lay.index("n") or kv.kwargs.get("dtype") is not None:
            continue
        outer = contraction(kv.args[0], inline=False)
        b2 = unify(outer, [("k", _lay("bhnd", lay)), ("v", _lay("bhne", lay))], _lay("bhnde", lay)) \
            if outer is not None else None
        if b2 is None:
            continue
        return b["q"], b2["k"], b2["v"], c.scale * outer.scale, lay
    return None


def _den_of(node, letters: str):
    """Peel the broadcast views (`[..., None]`, unsqueeze(-1), a transpose) off a denominator whose dims are named
    `letters` (the output's b, h, n in its order, then a unit x; or three letters once peeled): (the (B, H, N) or
    (B, N, H) node behind them, or the node itself, with its letters)."""
    node = strip(node)
    if len(letters) == 4 and rank(node) == 4 and eq(shape(node)[-1], 1):
        for want in ("bhn", "bnh"):
            peeled = peel_to(node, letters, want)
            if peeled is not None:
                return strip(peeled), want
    return node, letters


def _matches_den(den, letters, M, fq, fk, scale, lay: str = "bhnd"):
    """den (dims named `letters`) == Σ_{j≤i} κ(i, j): the row sum of M, or φq·cumsum(φk) (same φ, same scale; fq and
    fk in `lay`)."""
    den = strip(den)
    if kind(den) == "sum" and strip(den.args[0]) is strip(M) and M is not None:
        if letters[:3] != "bhn":
            return False
        dim = arg(den, 1, "dim")
        dims = [dim] if isinstance(dim, int) else list(dim or [])
        return len(dims) == 1 and dims[0] % 4 == 3 and den.kwargs.get("dtype") is None
    if fq is None or letters[:3] != _lay("bhn", lay):
        return False
    base, c = scaled(den)
    con = contraction(base, inline=False)
    if con is None:
        if kind(base) == "sum" and arg(base, 2, "keepdim", False):
            inner = contraction(base.args[0], inline=False)
            dim = arg(base, 1, "dim")
            if inner is None or not isinstance(dim, int) or dim % 4 != 3:
                return False
            con = Contraction(inner.factors, inner.out[:3], inner.chains, inner.scale)
        else:
            return False
    if len(con.factors) != 2:
        return False
    for order in ((0, 1), (1, 0)):
        swapped = Contraction([con.factors[i] for i in order], con.out, [con.chains[i] for i in order], con.scale)
        b = unify(swapped, [("q", _lay("bhnd", lay)), ("kc", _lay("bhnd", lay))], _lay("bhn", lay))
        if b is None:
            continue
        q, cq = scaled(b["q"])
        kc = strip(b["kc"])
        if kind(kc) != "cumsum" or arg(kc, 1, "dim") % 4 != lay.index("n"):
            continue
        k, ck = scaled(kc.args[0])
        if strip(q) is strip(fq) and strip(k) is strip(fk) and close(c * cq * ck * con.scale, scale):
            return True
    return False


def _normaliser(o, M, fq, fk, scale, lay_o: str = "bhnd", lay_q: str = "bhnd"):
    """The user of o (in lay_o) that divides by (den + eps): (output node, eps) or (o, None)."""
    for user in o.users:
        k = kind(user)
        if k == "div" and user.args[0] is o and is_tensor(user.args[1]):
            den_eps, letters = user.args[1], lay_o[:3] + "x"
        elif k == "mul" and is_tensor(user.args[0]) and is_tensor(user.args[1]):
            other = user.args[1] if user.args[0] is o else user.args[0]
            other, letters = _den_of(other, lay_o[:3] + "x")
            if kind(other) == "div" and scalar(other.args[0]) == 1.0:
                den_eps = other.args[1]
            elif kind(other) == "reciprocal":
                den_eps = other.args[0]
            elif kind(other) == "pow" and scalar(other.args[1]) == -1.0:
                den_eps = other.args[0]
            else:
                continue
        else:
            continue
        den_eps, letters = _den_of(den_eps, letters)
        den, eps = den_eps, 0.0
        if kind(den_eps) == "add" and scalar(den_eps.args[1]) is not None:
            den, eps = den_eps.args[0], scalar(den_eps.args[1])
        elif kind(den_eps) == "add" and scalar(den_eps.args[0]) is not None:
            den, eps = den_eps.args[1], scalar(den_eps.args[0])
        den, letters = _den_of(den, letters)
        if eps >= 0 and shapes_eq(shape(user), shape(o)) and _matches_den(den, letters, M, fq, fk, scale, lay_q):
            return user, eps
    return o, None


def _match(node, cfg: config.Config) -> Match | None:
    mv = _times_v(node) if kind(node) in ("matmul", "einsum") else None
    gla = gated(node, *mv, cfg, _causal, _scores) if mv is not None else None
    if gla is not None:
        return gla
    if kind(node) == "add":
        parts = chunked_form(node, _causal)
        if parts is None:
            return None
        out, fq, fk, v, total, lay_q, lay_v = parts
        fm, fq_x, fk_x, qw, kw, scale = _pair(fq, fk, total)
        return _make(out, fm, fq_x, fk_x, v, qw, kw, scale, None, cfg, lay_q, lay_v)
    quad = _numerator_quadratic(node)
    if quad is not None:
        M, A, v, lay_v = quad
        s = _taylor_scores(strip(A))
        if s is not None:  # the Taylor kernel written on raw scores
            sc = _scores(s)
            if sc is None:
                return None
            q, k, scale, lay_q = sc
            fm, fq_x, fk_x, qw, kw = "based", q, k, None, None
            fq = fk = None  # only the row sum of M is this kernel's denominator
            total = scale
        else:
            sc = _scores(A)
            if sc is None:
                return None
            fq, fk, total, lay_q = sc
            fm, fq_x, fk_x, qw, kw, scale = _pair(fq, fk, total)
    else:
        st = _numerator_state(node)
        if st is None:
            return None
        fq0, fk0, v, cs, lay_q = st
        lay_v = lay_q
        fq, cq = scaled(fq0)
        fk, ck = scaled(fk0)
        M, total = None, cq * ck * cs
        if not shapes_eq(shape(fq), shape(fk)) or rank(fq) != 4:
            return None
        fm, fq_x, fk_x, qw, kw, scale = _pair(fq, fk, total)
    if not shapes_eq(heads_first(shape(v), lay_v)[:3], heads_first(shape(fq_x), lay_q)[:3]):
        return None
    out, eps = _normaliser(node, M, fq, fk, total, lay_v, lay_q)
    return _make(out, fm, fq_x, fk_x, v, qw, kw, scale, eps, cfg, lay_q, lay_v)


def _pair(fq, fk, scale):
    """The op's (feature_map, q, k, q_weight, k_weight, scale) for scores scale·φq·φk."""
    nq, xq, wq = feature_map(fq)
    nk, xk, wk = feature_map(fk)
    if nq == nk and shapes_eq(shape(xq), shape(xk)):
        if nq == "based" and close(scale, 1.0):
            return "based", xq, xk, None, None, 1.0 / math.sqrt(shape(xq)[-1])
        if nq in ("elu1", "hedgehog"):
            return nq, xq, xk, wq, wk, scale
    return "identity", fq, fk, None, None, scale


def _make(out, fm, q, k, v, qw, kw, scale, eps, cfg: config.Config, lay_q: str = "bhnd", lay_v: str = "bhnd") -> Match:
    """The op for o = linear attention of (q, k, v): q and k in lay_q, v and o in lay_v (tokens-first ones are handed
    to the op transposed, and its output transposed back)."""
    normalize = eps is not None
    tensors = [t for t in (q, k, v, qw, kw) if t is not None]
    examples = [example(t) for t in tensors]
    reason, output_dtypes = None, {}
    dtypes = {e.dtype for e in examples[:3]}
    if len(dtypes) != 1:
        reason = f"q/k/v dtypes differ ({sorted(map(str, dtypes))})"
    elif dtype(out) == torch.float32 and examples[2].dtype in (torch.bfloat16, torch.float16):
        # eager promoted the result (an fp32 parameter in the features under autocast, e.g. a Hedgehog map's bias):
        # the op computes in the inputs' dtype and its output is cast up
        output_dtypes = {0: examples[2].dtype}
    elif dtype(out) != examples[2].dtype:
        reason = f"output dtype {dtype(out)} differs from the inputs' {examples[2].dtype}"
    elif examples[2].dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reason = f"dtype {examples[2].dtype}"
    elif not shapes_eq(heads_first(shape(q), lay_q)[:3], heads_first(shape(v), lay_v)[:3]) \
            or not shapes_eq(shape(out), shape(v)):
        reason = "q/k/v shapes disagree"
    elif fm == "hedgehog" and (len(shape(qw)) not in (2, 3) or not eq(shape(qw)[-1], shape(kw)[-1])):
        reason = "hedgehog weights of different shapes"
    elif examples[0].device.type == "cuda" and not cfg.reference:
        reason = _ops.kernel_supports(fm, examples[2].dtype, shape(q)[-1], shape(v)[-1],
                                      None if qw is None else shape(qw)[-1])
    return Match(
        family=FAMILY,
        outputs=[out],
        target=torch.ops.tk.linear_attention.default,
        args=(*(Transpose(t) if lay == "bnhd" else t for t, lay in ((q, lay_q), (k, lay_q), (v, lay_v))),
              fm, qw, kw, float(scale), normalize, float(eps or 0.0)),
        output_transposed=lay_v == "bnhd",
        output_dtypes=output_dtypes,
        reason=reason,
        # the output's example value knows whether grad mode was on (parameters' alone do not)
        needs_grad=needs_grad(out),
        # the Based backward kernel, once validated on the GPU (on other devices reference mode trains anyway)
        has_backward_kernel=_ops.BACKWARD_KERNEL_VALIDATED,
        device=examples[0].device,
    )


def find(graph: fx.Graph, cfg: config.Config | None = None) -> Iterable[Match]:
    cfg = cfg or config.current()
    matches = []
    for node in list(graph.nodes):
        if kind(node) not in ("matmul", "einsum", "sum", "mul", "add"):
            continue
        try:
            m = _match(node, cfg)
        except _Kept as why:
            m = Match(family=FAMILY, outputs=[node], reason=str(why))
        except (ZeroDivisionError, TypeError, IndexError, AttributeError, KeyError, ValueError, RuntimeError):
            m = None  # not this family's computation (or not one we can read)
        if m is not None:
            matches.append(m)
    return matches
