"""The chunked spelling of causal linear attention, for patterns/linear_attention.py.

Research code (and FLA's `naive_chunk_linear_attn`) avoids the N² scores by splitting the tokens into n chunks of c,
q, k, v viewed as (B, H, n, c, d), and writes

    o = q S + ((q kᵀ) ∘ causal) v,     S = Σ over the earlier chunks of kᵀ v (an exclusive prefix over n),

then merges (n, c) back into the tokens. That is o_i = Σ_{j≤i} κ(q_i, k_j) v_j over the whole sequence, the op's
unnormalised form. Read here: the sum of the two terms (`inter + intra`, either order), the same chunked q, k and v in
both (python-scalar factors anywhere, their products equal), the causal mask on the chunk's (c, c) scores (proven as
the quadratic form's), the exclusive prefix as `cat([zeros, cumsum(kv, n)[:, :, :-1]], n)` or `cumsum(kv, n) - kv`,
each chunking a reshape of the token axis into (n, c) (heads-first, or tokens-first then permuted to heads-first,
einops' `b (n c) h d -> b h n c d` where Dynamo traces einops into these ops), and the output merged back the same
way. Anything else is not this form.
"""
from __future__ import annotations

from ._fx import arg, eq, is_tensor, is_zeros, kind, rank, scaled, shape, strip
from ._index import contraction, indexes, unify

# The chunked tensors' dims: b, h, n (chunk), c (query position in the chunk), m (key position), d (feature),
# e (value); the unchunked ones are (B, H, N, d) heads-first or (B, N, H, d) tokens-first.
TOKENS_FIRST_TO_CHUNKED = (0, 3, 1, 2, 4)  # (B, n, c, H, d) -> (B, H, n, c, d)
CHUNKED_TO_TOKENS_FIRST = (0, 2, 3, 1, 4)  # (B, H, n, c, e) -> (B, n, c, H, e)


def _permutation(node):
    """The dims of a permute (or of a transpose of two dims) of a rank-5 tensor, normalised, else None."""
    k = kind(node)
    if k == "permute":
        dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else tuple(dims)
        return tuple(d % 5 for d in dims) if len(dims) == 5 and all(isinstance(d, int) for d in dims) else None
    if k == "transpose" and all(isinstance(a, int) for a in node.args[1:3]):
        a, b = (d % 5 for d in node.args[1:3])
        dims = list(range(5))
        dims[a], dims[b] = b, a
        return tuple(dims)
    return None


def _splits(x5, x4, at: int) -> bool:
    """x5 and x4, one a reshape of the other, are the same values with x4's dim `at` split in two (n, c): the other
    dims are kept, and a reshape that runs keeps the element count, so n·c is x4's size there (also where the sizes
    are symbolic, n = N // c)."""
    s5, s4 = shape(x5), shape(x4)
    return s5 is not None and s4 is not None and len(s5) == 5 and len(s4) == 4 and \
        all(eq(s5[i], s4[i]) for i in range(at)) and all(eq(s5[i + 1], s4[i]) for i in range(at + 1, 4))


def _unchunk(xc, chunk):
    """The (B, H, N, d) or (B, N, H, d) tensor that xc, (B, H, n, c, d) with c = chunk, chunks: (x, layout) or None."""
    xc = strip(xc)
    if shape(xc) is None or len(shape(xc)) != 5 or not eq(shape(xc)[3], chunk):
        return None
    if kind(xc) == "reshape" and is_tensor(xc.args[0]) and _splits(xc, strip(xc.args[0]), 2):
        return strip(xc.args[0]), "bhnd"
    if _permutation(xc) == TOKENS_FIRST_TO_CHUNKED:
        split = strip(xc.args[0])
        if kind(split) == "reshape" and is_tensor(split.args[0]) and _splits(split, strip(split.args[0]), 1):
            return strip(split.args[0]), "bnhd"
    return None


def _merged(o5):
    """The one user chain of o5, (B, H, n, c, e), that merges the chunks back into tokens: (node, layout) or None."""
    if len(o5.users) != 1:
        return None
    user = next(iter(o5.users))
    if kind(user) == "reshape" and user.args[0] is o5 and rank(user) == 4 and _splits(o5, user, 2):
        return user, "bhnd"
    if _permutation(user) == CHUNKED_TO_TOKENS_FIRST and len(user.users) == 1:
        merge = next(iter(user.users))
        if kind(merge) == "reshape" and merge.args[0] is user and rank(merge) == 4 and _splits(user, merge, 1):
            return merge, "bnhd"
    return None


def _exclusive_prefix(S):
    """S = Σ over the earlier chunks (dim 2) of kv: (kv, its factor) or None."""
    S, factor = scaled(S)
    k = kind(S)

    def cumsum_of(node):
        node = strip(node)
        ok = kind(node) == "cumsum" and arg(node, 1, "dim") % 5 == 2 and node.kwargs.get("dtype") is None
        return strip(node.args[0]) if ok else None

    if k == "sub" and not S.kwargs and is_tensor(S.args[0]) and is_tensor(S.args[1]):
        kv = cumsum_of(S.args[0])
        if kv is not None and strip(S.args[1]) is kv:
            return kv, factor
    if k == "cat" and arg(S, 1, "dim", 0) % 5 == 2:
        parts = arg(S, 0, "tensors")
        if isinstance(parts, (list, tuple)) and len(parts) == 2 and is_zeros(parts[0]) and \
                shape(parts[0]) is not None and eq(shape(parts[0])[2], 1):
            before = strip(parts[1])
            if indexes(before, (slice(None), slice(None), slice(None, -1))):
                kv = cumsum_of(before.args[0])
                if kv is not None:
                    return kv, factor
    return None


def chunked_form(node, causal):
    """node = inter + intra (causal: the quadratic form's reader of causally masked scores, M -> A or None):
    (out, q, k, v, scale, layout of q and k, layout of v and out) with out = the op's o, or None."""
    if kind(node) != "add" or node.kwargs or len(node.args) != 2 or rank(node) != 5 \
            or not all(is_tensor(a) for a in node.args):
        return None
    merged = _merged(node)
    if merged is None:
        return None
    out, lay_o = merged
    for intra_n, inter_n in ((node.args[1], node.args[0]), (node.args[0], node.args[1])):
        intra = contraction(intra_n, inline=False)
        b = unify(intra, [("m", "bhncm"), ("v", "bhnme")], "bhnce") if intra is not None else None
        if b is None:
            continue
        M, cm = scaled(b["m"])
        A = causal(M)
        chunk = shape(M)[-1] if shape(M) is not None else None
        scores = contraction(strip(A), inline=False) if A is not None else None
        s = unify(scores, [("q", "bhncd"), ("k", "bhnmd")], "bhncm") if scores is not None else None
        inter = contraction(inter_n, inline=False)
        t = unify(inter, [("q", "bhncd"), ("s", "bhnde")], "bhnce") if inter is not None else None
        if s is None or t is None:
            continue
        prefix = _exclusive_prefix(t["s"])
        kv = contraction(prefix[0], inline=False) if prefix is not None else None
        u = unify(kv, [("k", "bhnmd"), ("v", "bhnme")], "bhnde") if kv is not None else None
        if u is None:
            continue
        (q, cq), (k, ck), (v, cv) = scaled(s["q"]), scaled(s["k"]), scaled(b["v"])
        (q2, cq2), (k2, ck2), (v2, cv2) = scaled(t["q"]), scaled(u["k"]), scaled(u["v"])
        if strip(q) is not strip(q2) or strip(k) is not strip(k2) or strip(v) is not strip(v2):
            continue
        scale = intra.scale * cm * scores.scale * cq * ck * cv
        if abs(scale - inter.scale * prefix[1] * kv.scale * cq2 * ck2 * cv2) > 1e-6 * abs(scale):
            continue
        q4, k4, v4 = _unchunk(q, chunk), _unchunk(k, chunk), _unchunk(v, chunk)
        if q4 is None or k4 is None or v4 is None or q4[1] != k4[1] or v4[1] != lay_o:
            continue
        return out, q4[0], k4[0], v4[0], scale, q4[1], v4[1]
    return None
