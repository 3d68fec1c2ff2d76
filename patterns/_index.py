"""Index notation for the matchers: `full_index`/`indexes` (getitem read as per-dim entries), `view_chain`/`peel_to`
(views as renamed index letters), `contraction` (einsum, matmul, broadcast products and sums read as one Σ Π) and
`unify` (a contraction against a template)."""
from __future__ import annotations

import itertools

import torch.fx as fx

from ._fx import arg, eq, is_tensor, kind, scaled, shape, shapes_eq, static_int, strip

def full_index(index, rank: int):
    """A getitem index as one entry per dim: Ellipsis expanded, trailing dims as full slices (None: an index this
    matcher does not read, such as a tensor or a new axis)."""
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1 or any(i is None or not isinstance(i, (int, slice, type(Ellipsis))) for i in index):
        return None
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (rank - len(index) + 1) + index[k + 1:]
    return index + (slice(None),) * (rank - len(index))


def _index_entry(entry, size):
    """One dim's index entry in a normal form where the size is known: t[..., -1] is t[..., T - 1], t[..., -1:] is
    t[..., T - 1:] and t[..., :] is t[..., 0:T]."""
    n = static_int(size)
    if n is None:
        return entry
    if isinstance(entry, int) and not isinstance(entry, bool) and -n <= entry < n:
        return entry % n
    if isinstance(entry, slice) and all(v is None or isinstance(v, int) for v in (entry.start, entry.stop, entry.step)):
        return slice(*entry.indices(n))
    return entry


def indexes(node, index) -> bool:
    """`node` is `t[index]`, in any spelling of the same index (`t[:, :, :, -1]`, `t[..., -1]`, `t[..., T - 1]`)."""
    if kind(node) != "getitem" or shape(node.args[0]) is None:
        return False
    sizes = shape(node.args[0])
    got, want = full_index(node.args[1], len(sizes)), full_index(index, len(sizes))
    if got is None or want is None:
        return False
    return all(_index_entry(g, n) == _index_entry(w, n) for g, w, n in zip(got, want, sizes))


def peel_to(node, letters: str, want: str):
    """The view of `node` (positions named by `letters`) whose positions are exactly `want`,
    e.g. peel_to(x[..., None], "abcz", "abc") -> x; None if there is none."""
    for n, l in view_chain(node, letters) or ():
        if l == want:
            return n
    return None


def view_chain(node, letters: str):
    """Every (node, letters) met while peeling views off `node`, outermost first (each holds the
    same values under another index naming); None if some view is not representable."""
    chain = []
    while True:
        node = strip(node)
        if shape(node) is None:
            return None
        k = kind(node)
        rank = len(letters)
        if len(shape(node)) == rank:
            chain.append((node, letters))
        if k == "getitem" and isinstance(node.args[1], tuple):
            idx = node.args[1]
            if not all(i is None or i is Ellipsis or i == slice(None) for i in idx) or sum(i is Ellipsis for i in idx) > 1:
                return chain or None
            base_rank = len(shape(node.args[0]) or ())
            n_ellipsis = base_rank - sum(i is not None and i is not Ellipsis for i in idx)
            pos, kept = 0, []
            for i in idx:
                if i is Ellipsis:
                    kept.extend(letters[pos:pos + n_ellipsis])
                    pos += n_ellipsis
                elif i is None:
                    pos += 1
                else:
                    kept.append(letters[pos])
                    pos += 1
            kept.extend(letters[pos:])
            letters, node = "".join(kept), node.args[0]
        elif k == "unsqueeze":
            d = arg(node, 1, "dim") % rank
            letters, node = letters[:d] + letters[d + 1:], node.args[0]
        elif k == "reshape" and _inserted_one(node) is not None:  # einops' way to add an axis
            d = _inserted_one(node)
            letters, node = letters[:d] + letters[d + 1:], node.args[0]
        elif k == "permute":
            dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
            dims = [d % rank for d in dims]
            base = [""] * rank
            for i, d in enumerate(dims):
                base[d] = letters[i]
            letters, node = "".join(base), node.args[0]
        elif k in ("transpose", "mT"):
            a, b = (-2, -1) if k == "mT" else (arg(node, 1, "dim0"), arg(node, 2, "dim1"))
            lst = list(letters)
            lst[a % rank], lst[b % rank] = lst[b % rank], lst[a % rank]
            letters, node = "".join(lst), node.args[0]
        else:
            return chain or None


def _inserted_one(node):
    """d if reshape `node` only inserts a size-1 axis at position d of its input (an unsqueeze)."""
    out, src = shape(node), shape(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if out is None or src is None or len(out) != len(src) + 1:
        return None
    for d in range(len(out)):
        if eq(out[d], 1) and shapes_eq(out[:d] + out[d + 1:], src):
            return d
    return None


class Contraction:
    """Σ over the letters missing from `out` of Π factors[i][0][letters_i] (einsum semantics).

    `chains[i]` lists the same factor before its view ops were peeled off (outermost first), so
    a template can bind the tensor in the layout it expects."""

    def __init__(self, factors, out, chains=None, scale=1.0):
        self.factors, self.out, self.scale = factors, out, scale  # scale: python-scalar factors met
        self.chains = chains if chains is not None else [[f] for f in factors]

    def __repr__(self):
        return f"Contraction({[(n.name, l) for n, l in self.factors]} -> {self.out})"


LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def contraction(node, *, inline=True, _fresh=None) -> Contraction | None:
    """Read einsum, broadcast products and sums of products as one contraction.

    With `inline`, factors that are themselves contractions are expanded (so HF's mul/sum
    chains and mamba's 4-operand einsum read the same)."""
    fresh = _fresh if _fresh is not None else iter(LETTERS)
    node = strip(node)
    k = kind(node)
    if k == "einsum":
        equation = node.args[0]
        operands = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else list(node.args[1:])
        if not isinstance(equation, str) or "->" not in equation:
            return None
        lhs, out = equation.replace(" ", "").split("->")
        terms = lhs.split(",")
        if len(terms) != len(operands):
            return None
        rename = {}

        def ren(s, rank):
            if "..." in s:
                n_ell = rank - (len(s) - 3)
                s = s.replace("...", "".join(f"#{i}" for i in range(n_ell)))
                parts, i = [], 0
                while i < len(s):
                    if s[i] == "#":
                        j = i + 1
                        while j < len(s) and s[j].isdigit():
                            j += 1
                        parts.append(s[i:j])
                        i = j
                    else:
                        parts.append(s[i])
                        i += 1
            else:
                parts = list(s)
            res = ""
            for p in parts:
                if p not in rename:
                    rename[p] = next(fresh)
                res += rename[p]
            return res

        factors = []
        for t, op in zip(terms, operands):
            if shape(op) is None:
                return None
            factors.append((op, ren(t, len(shape(op)))))
        out_rank = len(shape(node) or ())
        out_letters = ren(out, out_rank) if "..." in out else "".join(rename.get(c) or next(fresh) for c in out)
    elif k == "matmul":
        a, b = node.args[0], node.args[1]
        sa, sb = shape(a), shape(b)
        if sa is None or sb is None or len(sa) != len(sb) or len(sa) < 2 or sa[:-2] != sb[:-2]:
            return None
        batch = "".join(next(fresh) for _ in sa[:-2])
        n, d, m = next(fresh), next(fresh), next(fresh)
        factors = [(a, batch + n + d), (b, batch + d + m)]
        out_letters = batch + n + m
    elif k == "mul":
        a, b = node.args[0], node.args[1]
        if not (is_tensor(a) and is_tensor(b)) or node.kwargs:
            return None
        out_shape = shape(node)
        out_letters = "".join(next(fresh) for _ in out_shape)
        factors = []
        for op in (a, b):
            lead = len(out_shape) - len(shape(op))
            factors.append((op, out_letters[lead:]))
        sizes = dict(zip(out_letters, out_shape))
    elif k == "sum":
        dims = arg(node, 1, "dim")
        keepdim = arg(node, 2, "keepdim", False)
        if dims is None or node.kwargs.get("dtype") is not None:
            return None
        dims = [dims] if isinstance(dims, int) else list(dims)
        inner = contraction(node.args[0], inline=inline, _fresh=fresh)
        if inner is None:
            return None
        rank = len(inner.out)
        dims = {d % rank for d in dims}
        if keepdim:
            return None  # keepdim sums are read by callers as sum + unsqueeze
        out = "".join(c for i, c in enumerate(inner.out) if i not in dims)
        return Contraction(inner.factors, out, inner.chains, inner.scale)
    else:
        return None
    # peel views off every factor; inline nested contractions
    result, chains, total = [], [], 1.0
    for op, letters in factors:
        chain = view_chain(op, letters)
        if chain is None:
            return None
        base, base_letters = chain[-1]
        unscaled, factor = scaled(base)
        if unscaled is not base:  # python-scalar factors are collected in Contraction.scale
            chain = view_chain(unscaled, base_letters)
            if chain is None:
                return None
            base, base_letters = chain[-1]
            total *= factor
        if k == "mul" and not all(eq(sizes[c], n) for c, n in zip(base_letters, shape(base))):
            return None  # a real size-1 broadcast: not index notation we read
        if inline and kind(base) in ("einsum", "mul", "sum", "matmul"):
            inner = contraction(base, inline=True, _fresh=fresh)
            if inner is not None:
                mapping = dict(zip(inner.out, base_letters))
                if len(mapping) != len(inner.out):
                    return None
                total *= inner.scale
                for (ib, il), ichain in zip(inner.factors, inner.chains):
                    result.append((ib, "".join(mapping.get(c, c) for c in il)))
                    chains.append([(cn, "".join(mapping.get(c, c) for c in cl)) for cn, cl in ichain])
                continue
        result.append((base, base_letters))
        chains.append(chain)
    return Contraction(result, out_letters, chains, total)


def unify(c: Contraction, template: list[tuple[str, str]], out: str, bound: dict | None = None) -> dict | None:
    """Match a contraction against `template` [(variable, letters)] -> `out` up to letter renaming
    and factor order. Variables bind to nodes (pre-bound ones must agree). Returns the bindings."""
    if c is None or len(c.factors) != len(template) or len(c.out) != len(out):
        return None
    for perm in itertools.permutations(range(len(c.factors))):
        bindings = dict(bound or {})
        letter_map = dict(zip(out, c.out))
        if len(set(letter_map.values())) != len(letter_map):
            return None
        ok = True
        for (var, tletters), j in zip(template, perm):
            for node, aletters in c.chains[j]:  # the first layout that agrees with the template
                if len(tletters) != len(aletters) or bindings.get(var, node) is not node:
                    continue
                trial = dict(letter_map)
                if all(trial.setdefault(t, a) == a for t, a in zip(tletters, aletters)) \
                        and len(set(trial.values())) == len(trial):
                    letter_map = trial
                    bindings[var] = node
                    break
            else:
                ok = False
                break
        if ok:
            return bindings
    return None


def heads_first(sizes, layout: str):
    """Sizes of a (B, H, N, ...) tensor held in `layout`, "bhnd" (heads first) or "bnhd" (tokens first), in heads-first
    order (None stays None)."""
    return None if sizes is None else tuple(sizes) if layout == "bhnd" else (sizes[0], sizes[2], sizes[1], *sizes[3:])
