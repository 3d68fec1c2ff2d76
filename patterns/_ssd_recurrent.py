"""The SSD written as its token-by-token recurrence (patterns/ssd.py's second spelling) -> `tk::ssd`.

A Python loop over the tokens, which Dynamo unrolls, as in the Mamba-2 paper's recurrent form and
tk_inductor.ops.ssd.ssd_recurrence:

    for t in range(l):
        h = exp(dt[:, t] * A)[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(einsum("bhpn,bhn->bhp", h, C[:, t])  (+ D[:, None] * x[:, t]))
    y = torch.stack(ys, dim=1)

Anchored on `stack(ys, dim=1)` (or the `cat` of the ys given a sequence axis); every token's output is read back to the inputs: products are read by
which tensor each factor is a token of (x[:, t], x.unbind(1)[t], x.select(1, t)) and which of the output's
axes (batch, head, head dim, state dim) its axes broadcast to, so the order of factors, einsum or broadcast
products, and x·dt formed before the loop all read the same. Token t must read token t of the same x, dt,
B, C for every t from 0 to l - 1, and h before token 0 must be zeros or an initial state. B and C may be per
group (expanded to heads as in the chunked form). Anything else leaves the graph as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tk_inductor import config
from tk_inductor.ops import ssd as ssd_ops
from tk_inductor.rewrite import Match, example

from ._fx import arg, dtype, eq, is_tensor, is_zeros, kind, needs_grad, rank, shape, shapes_eq, strip, through_upcasts
from .ssd import FAMILY, _heads_from_groups, _kept_reason, _need, _NoMatch

BATCH, HEAD, HEADDIM, STATE = "b", "h", "p", "n"


def _index(idx, base_rank: int):
    """A getitem index of slices, None and at most one int, the int at the base's axis 1 (the sequence):
    (that int or None, the positions of the axes None inserts); None for any other index."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if sum(i is Ellipsis for i in idx) > 1:
        return None
    taken = sum(i is not None and i is not Ellipsis for i in idx)
    t, inserted, src_axis, out_axis = None, [], 0, 0
    for i in idx:
        if i is Ellipsis:
            src_axis += base_rank - taken
            out_axis += base_rank - taken
        elif i is None:
            inserted.append(out_axis)
            out_axis += 1
        elif isinstance(i, int) and not isinstance(i, bool):
            if src_axis != 1 or t is not None:
                return None
            t = i
            src_axis += 1
        elif i == slice(None):
            src_axis += 1
            out_axis += 1
        else:
            return None
    return t, inserted


def _leaf(node):
    """(source, t, inserted): `node` is token t of `source` (x[:, t], x.select(1, t), x.unbind(1)[t]; t None: the
    source itself) with size-1 axes inserted at `inserted` (x[:, t, :, None], unsqueeze), through upcasts."""
    node = through_upcasts(node)
    k = kind(node)
    if k == "unsqueeze" and isinstance(arg(node, 1, "dim"), int):
        src, t, inner = _leaf(node.args[0])
        d = arg(node, 1, "dim") % rank(node)
        return src, t, sorted([i + (i >= d) for i in inner] + [d])
    if k == "select" and arg(node, 1, "dim") == 1 and isinstance(arg(node, 2, "index"), int):
        return through_upcasts(node.args[0]), arg(node, 2, "index"), []
    if k == "getitem" and kind(node.args[0]) == "unbind" and arg(node.args[0], 1, "dim", 0) == 1 \
            and isinstance(node.args[1], int):
        return through_upcasts(node.args[0].args[0]), node.args[1], []
    if k == "getitem" and shape(node.args[0]) is not None and not isinstance(node.args[1], fx.Node):
        parsed = _index(node.args[1], rank(node.args[0]))
        if parsed is not None:
            t, inserted = parsed
            if t is not None:
                return through_upcasts(node.args[0]), t, inserted
            src, t, inner = _leaf(node.args[0])
            kept = [i for i in range(rank(node)) if i not in inserted]
            return src, t, sorted(inserted + [kept[i] for i in inner])
    return node, None, []


def _factors(node, axes: tuple):
    """The factors of a product whose axes are named `axes` (one name per axis, None for an axis of size 1):
    [(source, t, the names of the source's axes but the sequence)], reading broadcast `mul`s and einsum; a
    non-product is one factor."""
    node = strip(node)
    if kind(node) == "mul" and not node.kwargs and is_tensor(node.args[0]) and is_tensor(node.args[1]):
        out = []
        for a in node.args[:2]:
            lead = len(axes) - rank(a)
            _need(lead >= 0, "a factor of higher rank than the product")
            out += _factors(a, tuple(n if eq(s, shape(node)[lead + i]) else None
                                     for i, (n, s) in enumerate(zip(axes[lead:], shape(a)))))
        return out
    if kind(node) == "einsum" and isinstance(node.args[0], str) and "->" in node.args[0] and "." not in node.args[0]:
        lhs, rhs = node.args[0].replace(" ", "").split("->")
        operands = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        terms = lhs.split(",")
        if len(terms) == len(operands) and len(rhs) == len(axes) and set(lhs.replace(",", "")) <= set(rhs):
            name = dict(zip(rhs, axes))
            return [f for term, op in zip(terms, operands) for f in _factors(op, tuple(name[c] for c in term))]
    src, t, inserted = _leaf(node)
    _need(all(axes[i] is None for i in inserted), "a size-1 axis broadcast")
    names = tuple(n for i, n in enumerate(axes) if i not in inserted)
    if t is None and src is not node and kind(strip(src)) in ("mul", "einsum"):  # a product given new axes
        return _factors(src, names)
    return [(src, t, names)]


def _bind(factors, template: dict, t: int, sources: dict):
    """Binds a token's factors to the template {role: axis names}: each factor is token t of the role's source
    (bound once across tokens in `sources`), or, for roles A and D, a whole (h) tensor."""
    _need(len(factors) == len(template), f"{sorted(template)}: {len(factors)} factors")
    left = dict(template)
    for src, tok, names in factors:
        for role, want in list(left.items()):
            whole = role in ("A", "D")
            if names != want or (tok is None) != whole or (not whole and tok != t):
                continue
            if sources.setdefault(role, src) is src:
                del left[role]
                break
        else:
            raise _NoMatch(f"token {t}: a factor of {sorted(template)} is not the expected token")


def _readout(y, t: int, sources: dict, skip: bool = False):
    """y_t = h_t·C_t (+ D·x_t, once) -> h_t; binds C (and D, x). skip: the D·x term has been read."""
    y = strip(y)
    if kind(y) == "add" and is_tensor(y.args[0]) and is_tensor(y.args[1]):
        _need(not skip, f"token {t}: more than one term beside the readout")
        for r, dx in ((y.args[0], y.args[1]), (y.args[1], y.args[0])):
            try:
                trial = dict(sources)
                _bind(_factors(dx, (BATCH, HEAD, HEADDIM)), {"D": (HEAD,), "x": (BATCH, HEAD, HEADDIM)}, t, trial)
            except _NoMatch:
                continue
            sources.update(trial)
            return _readout(r, t, sources, skip=True)
        raise _NoMatch(f"token {t}: an output term is not D·x")
    if kind(y) == "sum":
        dims = arg(y, 1, "dim")
        dims = [dims] if isinstance(dims, int) else list(dims or ())
        _need(len(dims) == 1 and dims[0] % 4 == 3 and not arg(y, 2, "keepdim", False), f"token {t}: readout sum")
        factors = _factors(y.args[0], (BATCH, HEAD, HEADDIM, STATE))
    elif kind(y) == "einsum" and isinstance(y.args[0], str):
        lhs, rhs = y.args[0].replace(" ", "").split("->")
        ops = y.args[1] if len(y.args) == 2 and isinstance(y.args[1], (list, tuple)) else y.args[1:]
        terms = lhs.split(",")
        summed = set(lhs.replace(",", "")) - set(rhs)
        _need(len(terms) == 2 and len(rhs) == 3 and len(summed) == 1, f"token {t}: readout einsum")
        name = dict(zip(rhs, (BATCH, HEAD, HEADDIM)), **{summed.pop(): STATE})
        factors = [f for term, op in zip(terms, ops) for f in _factors(op, tuple(name[c] for c in term))]
    else:
        raise _NoMatch(f"token {t}: output is not a readout of the state")
    _need(len(factors) == 2, f"token {t}: readout factors")
    for h, c in (factors, factors[::-1]):
        if h[1] is None and h[2] == (BATCH, HEAD, HEADDIM, STATE):
            _bind([c], {"C": (BATCH, HEAD, STATE)}, t, sources)
            return h[0]
    raise _NoMatch(f"token {t}: no state in the readout")


def _update(h, t: int, sources: dict):
    """h_t = exp(dt_t·A) h_{t-1} + (dt_t x_t) ⊗ B_t -> h_{t-1}; binds dt, A, x (or X = x·dt), B."""
    h = strip(h)
    _need(kind(h) == "add" and is_tensor(h.args[0]) and is_tensor(h.args[1]), f"token {t}: state is not a sum")
    state_axes = (BATCH, HEAD, HEADDIM, STATE)
    for decay_term, input_term in ((h.args[0], h.args[1]), (h.args[1], h.args[0])):
        try:
            factors = _factors(decay_term, state_axes)
        except _NoMatch:
            continue
        decay = [f for f in factors if f[1] is None and f[2] == (BATCH, HEAD) and kind(strip(f[0])) == "exp"]
        prev = [f for f in factors if f[1] is None and f[2] == state_axes]
        if len(factors) != 2 or len(decay) != 1 or len(prev) != 1:
            continue
        _bind(_factors(strip(decay[0][0]).args[0], (BATCH, HEAD)), {"dt": (BATCH, HEAD), "A": (HEAD,)}, t, sources)
        inputs = _factors(input_term, state_axes)
        if len(inputs) == 2:  # x·dt formed before the loop
            _bind(inputs, {"X": (BATCH, HEAD, HEADDIM), "B": (BATCH, HEAD, STATE)}, t, sources)
        else:
            _bind(inputs, {"dt": (BATCH, HEAD), "x": (BATCH, HEAD, HEADDIM), "B": (BATCH, HEAD, STATE)}, t, sources)
        return prev[0][0]
    raise _NoMatch(f"token {t}: no decayed previous state")


def _x_and_dt(sources: dict):
    """x and dt from the bound roles: with X = x·dt formed before the loop, X must be x * dt[..., None] for the dt
    of the decays (and the x of D·x, if any)."""
    dt = sources["dt"]
    if "X" not in sources:
        return sources["x"], dt
    X = strip(sources["X"])
    _need(kind(X) == "mul" and is_tensor(X.args[0]) and is_tensor(X.args[1]), "x·dt")
    for x, d in ((X.args[0], X.args[1]), (X.args[1], X.args[0])):
        base, tok, inserted = _leaf(d)
        if tok is None and inserted == [rank(X) - 1] and base is dt:
            x = through_upcasts(x)
            _need(sources.setdefault("x", x) is x, "x·dt and D·x read different x")
            return x, dt
    raise _NoMatch("x·dt is not x * dt[..., None]")


def _outputs(node) -> list | None:
    """The tokens' outputs y_t (b, h, p) that `node` joins along the sequence: torch.stack(ys, dim=1), or
    torch.cat of each y_t given a sequence axis (y[:, None], y.unsqueeze(1)) along it; None otherwise."""
    items = arg(node, 0, "tensors")
    if kind(node) not in ("stack", "cat") or arg(node, 1, "dim", 0) not in (1, -3) \
            or not isinstance(items, (list, tuple)) or len(items) < 2 or not all(is_tensor(i) for i in items):
        return None
    if kind(node) == "cat":
        bases = [_leaf(i) for i in items]
        if any(tok is not None or inserted != [1] for _, tok, inserted in bases):
            return None
        items = [base for base, _, _ in bases]
    return list(items) if all(rank(y) == 3 for y in items) else None


def match(stack: fx.Node, cfg: config.Config) -> Match | None:
    """The recurrent SSD whose outputs `stack` joins (_outputs), or None."""
    ys = _outputs(stack)
    if ys is None:
        return None
    sources: dict = {}
    try:
        h_after = []
        for t, y in enumerate(ys):
            h = _readout(y, t, sources)
            h_after.append(h)
        for t, h in enumerate(h_after):
            prev = _update(h, t, sources)
            if t:
                _need(prev is h_after[t - 1], f"token {t}: the state is not token {t - 1}'s")
            else:
                h0 = prev
    except _NoMatch:
        return None  # only the full recurrence is this op; a partial reading leaves the graph alone
    try:
        return _verify(stack, sources, h0, h_after[-1], cfg)
    except _NoMatch as why:
        return Match(family=FAMILY, outputs=[stack], reason=f"recurrent SSD-like loop not provably Mamba-2 SSD ({why})")


def _verify(stack, sources, h0, h_last, cfg: config.Config) -> Match:
    x, dt = _x_and_dt(sources)
    A, D = sources["A"], sources.get("D")
    _need(rank(x) == 4, "x (b, l, h, p)")
    b, l, nh, p = shape(x)
    _need(eq(l, len(_outputs(stack))), "not every token of the sequence")
    _need(shapes_eq(shape(dt), (b, l, nh)) and shapes_eq(shape(A), (nh,)), "dt (b, l, h) and A (h)")
    _need(D is None or shapes_eq(shape(D), (nh,)), "D per head")
    B, C = _heads_from_groups(sources["B"], nh), _heads_from_groups(sources["C"], nh)
    _need(rank(B) == 4 and shapes_eq(shape(B), shape(C)) and eq(shape(B)[1], l), "B and C (b, l, g, n)")
    n = shape(B)[-1]
    init = None if is_zeros(h0) else through_upcasts(h0)
    _need(init is None or shapes_eq(shape(init), (b, nh, p, n)), "initial state shape")
    # y: the stack, or its cast back to x's dtype (a recurrence computed in fp32 from 16-bit inputs)
    y = stack
    users = list(stack.users)
    if dtype(stack) != dtype(x) and len(users) == 1 and kind(users[0]) in ("to", "type") \
            and dtype(users[0]) == dtype(x) and shapes_eq(shape(users[0]), shape(stack)):
        y = users[0]
    final = h_last if len(h_last.users) > 1 else None  # used beyond token l - 1's readout
    examples = [example(t) for t in (x, dt, A, B, C, D, init) if t is not None]
    return Match(
        family=FAMILY,
        outputs=[y, final],
        target=torch.ops.tk.ssd.default,
        args=(x, dt, A, B, C, D, init, 64),
        reason=_kept_reason(examples, x, y, final, n, cfg),
        needs_grad=needs_grad(stack),
        has_backward_kernel=ssd_ops.BACKWARD_KERNEL_VALIDATED,
        device=examples[0].device,
        # the op keeps the state in fp32; a recurrence computed in 16 bits has it in 16 bits
        output_dtypes={1: torch.float32} if final is not None and dtype(final) != torch.float32 else {},
    )
