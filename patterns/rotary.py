"""Matcher for rotary position embeddings on the Dynamo (torch-IR) graph -> `tk::rotary`.

The anchor is `x * cos + rot(x) * sin` (either operand order in each product and in the sum,
`operator`/`torch`/method spellings, x and rot(x) each possibly cast to fp32 first: ERNIE 4.5's
`q.float() * cos + rotate_half(q).float() * sin`), where rot is recognised structurally on the same x:

* NeoX / Llama `rotate_half`: `cat((-x[..., h:], x[..., :h]), dim=-1)` with h = d/2 (slices written
  with `...` or full leading slices, `torch.chunk(x, 2, -1)` halves, `-t` or `torch.neg`);
* GPT-J `rotate_every_two` / Cohere interleaved: `stack((-x[..., 1::2], x[..., ::2]), dim=-1)
  .flatten(-2)` (or `torch.flatten(t, -2)` / `start_dim=`);
* and, as its own anchor, gpt-oss's halves with half-width tables: `cat((x1·c − x2·s, x2·c + x1·s), -1)` (NeoX's
  rotation with cos = cat(c, c), sin = cat(s, s), which `rotary_ops.rotary_half_tables` builds);
* and the complex spelling (Meta's llama, torchtitan, HF Llama-4): `view_as_real(view_as_complex(x.float()
  .reshape(..., -1, 2)) * f).flatten(-2)`, GPT-J's interleaved rotation with cos, sin = f's real and imaginary parts
  repeated per pair (`rotary_ops.rotary_complex_tables`).

Partial rotary (GPT-NeoX `rotary_ndims`, Phi, GPT-J `rotary_dim`): when x is `X[..., :r]` and the
sum is concatenated with `X[..., r:]` (`cat([rot_part, X[..., r:]], -1)`), the op takes X whole and
copies the pass-through channels. rotary_dim = cos.shape[-1]; cos/sin are passed as they are (the
op broadcasts them: HF's (B, N, r) unsqueezed at dim 1 or 2, GPT-J's repeat_interleave'd tables).
Two matches with the same cos, sin and variant (q and k of one layer) become one launch.

Dtypes: cos/sin may have another dtype than x (fp32 tables on bf16 activations, as HF computes them
under autocast): the result is promoted, as in eager. When the result's only use is a cast to
another dtype (autocast's cast in front of attention, made explicit by tk_inductor/autocast.py),
the op writes that dtype directly: the same single rounding of the fp32 result (narrowing casts only: a
widening one is left to its reader). An x that is an exact upcast of 16-bit values (Cohere's `q.float()`) is read
as those values: the kernel computes in fp32 either way.

Kept, with the reason: cos/sin that require grad (learned tables), outputs whose layout is neither
x's nor contiguous, cos/sin that do not broadcast to x's rotary part, odd rotary dims, and (kernel
mode on CUDA) dtype combinations the kernel does not take.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx

from tk_inductor import config
from tk_inductor.ops import rotary as rotary_ops
from tk_inductor.rewrite import Match

from ._fx import arg as _arg, cast_dtype, fused_cast, is_call as _is, tensor as _tensor, upcast_source

FAMILY = "rotary"

_ADD = {operator.add, torch.add}
_MUL = {operator.mul, torch.mul}
_NEG = {operator.neg, torch.neg}
_CAT = {torch.cat, torch.concat, torch.concatenate} if hasattr(torch, "concatenate") else {torch.cat, torch.concat}
_STACK = {torch.stack}


def _binary(node: Any, fns: set, method: str) -> tuple[Any, Any] | None:
    if _is(node, fns, method) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        return node.args[0], node.args[1]
    return None


def _dim_is_last(dim: Any, rank: int, offset: int = 0) -> bool:
    """dim names axis rank-1-offset (the last, or the one before it for offset=1)."""
    return isinstance(dim, int) and dim in (-1 - offset, rank - 1 - offset)


# ---------------------------------------------------------------------------- last-dim slices

def _last_slice(node: Any) -> tuple[fx.Node, int, int | None, int] | None:
    """node = X[..., start:stop:step] slicing only the last dim -> (X, start, stop, step)."""
    if not _is(node, {operator.getitem}):
        return None
    base, idx = node.args
    tb = _tensor(base)
    if tb is None or not isinstance(idx, tuple) or not idx:
        return None
    last = idx[-1]
    lead = idx[:-1]
    if not isinstance(last, slice):
        return None
    if lead == (Ellipsis,):
        pass
    elif len(lead) == tb.dim() - 1 and all(s == slice(None, None, None) for s in lead):
        pass
    else:
        return None
    d = tb.shape[-1]
    try:
        start, stop, step = last.indices(int(d))
    except (TypeError, ValueError):
        return None
    return base, start, stop, step


def _chunk_half(node: Any) -> tuple[fx.Node, int] | None:
    """node = torch.chunk(X, 2, -1)[i] -> (X, i)."""
    if not _is(node, {operator.getitem}) or not isinstance(node.args[1], int):
        return None
    ch = node.args[0]
    if not _is(ch, {torch.chunk}, "chunk"):
        return None
    base = ch.args[0]
    tb = _tensor(base)
    if tb is None or _arg(ch, 1, "chunks") != 2 or not _dim_is_last(_arg(ch, 2, "dim", 0), tb.dim()):
        return None
    return base, node.args[1]


def _half_of(node: Any) -> tuple[fx.Node, str] | None:
    """node is X's first ("lo") or second ("hi") half along the last dim."""
    s = _last_slice(node)
    if s is not None:
        base, start, stop, step = s
        d = int(_tensor(base).shape[-1])
        if step != 1 or d % 2:
            return None
        if (start, stop) == (0, d // 2):
            return base, "lo"
        if (start, stop) == (d // 2, d):
            return base, "hi"
        return None
    c = _chunk_half(node)
    if c is not None and int(_tensor(c[0]).shape[-1]) % 2 == 0:
        return c[0], ("lo", "hi")[c[1]]
    return None


def _parity_of(node: Any) -> tuple[fx.Node, str] | None:
    """node is X[..., 0::2] ("even") or X[..., 1::2] ("odd")."""
    s = _last_slice(node)
    if s is None:
        return None
    base, start, stop, step = s
    d = int(_tensor(base).shape[-1])
    if step != 2 or stop != d or d % 2:
        return None
    return (base, "even") if start == 0 else (base, "odd") if start == 1 else None


def _negated(node: Any) -> Any:
    if _is(node, _NEG, "neg"):
        return node.args[0]
    return None


# ---------------------------------------------------------------------------- rot(x)

def _cat_pair(node: Any) -> tuple[Any, Any] | None:
    """node = cat((a, b), -1) -> (a, b)."""
    if not _is(node, _CAT, "cat"):
        return None
    parts, dim = node.args[0], _arg(node, 1, "dim", 0)
    tn = _tensor(node)
    if tn is None or not isinstance(parts, (list, tuple)) or len(parts) != 2 or not _dim_is_last(dim, tn.dim()):
        return None
    return parts[0], parts[1]


def _rotate_half(node: Any) -> fx.Node | None:
    """cat((-x_hi, x_lo), -1) -> x."""
    parts = _cat_pair(node)
    if parts is None:
        return None
    hi = _half_of(_negated(parts[0]))
    lo = _half_of(parts[1])
    if hi is None or lo is None or hi != (lo[0], "hi") or lo[1] != "lo":
        return None
    return lo[0]


def _rotate_pairs(node: Any) -> fx.Node | None:
    """stack((-x_odd, x_even), -1).flatten(-2) -> x."""
    if _is(node, {torch.flatten}, "flatten"):
        src = node.args[0]
        ts = _tensor(src)
        if ts is None:
            return None
        start, end = _arg(node, 1, "start_dim", 0), _arg(node, 2, "end_dim", -1)
        if not (_dim_is_last(start, ts.dim(), 1) and _dim_is_last(end, ts.dim())):
            return None
    else:
        return None
    if not _is(src, _STACK, "stack"):
        return None
    parts, dim = src.args[0], _arg(src, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not _dim_is_last(dim, _tensor(src).dim()):
        return None
    odd = _parity_of(_negated(parts[0]))
    even = _parity_of(parts[1])
    if odd is None or even is None or odd != (even[0], "odd") or even[1] != "even":
        return None
    return even[0]


def _rotation(node: Any) -> tuple[fx.Node, bool] | None:
    """node = rot(x) -> (x, interleaved)."""
    x = _rotate_half(node)
    if x is not None:
        return x, False
    x = _rotate_pairs(node)
    if x is not None:
        return x, True
    return None


# ---------------------------------------------------------------------------- the anchor

def _exact_float(node: Any) -> Any:
    """`node` with a cast to fp32 that changes no value stripped (from fp32, fp16 or bf16: ERNIE 4.5 writes
    `q.float() * cos + rotate_half(q).float() * sin`); other nodes as they are. The anchor's dtype is checked
    against x's promoted with cos's (`_reason`), so a cast that changes the result's dtype keeps the match."""
    if cast_dtype(node) == torch.float32 and getattr(_tensor(node.args[0]), "dtype", None) == torch.float32:
        return node.args[0]  # a cast that changes nothing
    return upcast_source(node)


def _anchor(node: fx.Node):
    """x*cos + rot(x)*sin -> (x, cos, sin, interleaved); x and rot(x) may each be cast to fp32 first."""
    terms = _binary(node, _ADD, "add")
    if terms is None:
        return None
    for t_plain, t_rot in (terms, terms[::-1]):
        pm, rm = _binary(t_plain, _MUL, "mul"), _binary(t_rot, _MUL, "mul")
        if pm is None or rm is None:
            continue
        for r, sin in (rm, rm[::-1]):
            found = _rotation(_exact_float(r))
            if found is None or not isinstance(sin, fx.Node):
                continue
            x, interleaved = found
            for a, cos in (pm, pm[::-1]):
                if (a is x or _exact_float(a) is x) and isinstance(cos, fx.Node):
                    return x, cos, sin, interleaved
    return None


def _product(node: Any, a: Any) -> Any:
    """node = a * t or t * a -> t (None otherwise)."""
    m = _binary(node, _MUL, "mul")
    if m is None:
        return None
    return m[1] if m[0] is a else m[0] if m[1] is a else None


def _anchor_halves(node: fx.Node):
    """cat((x1·c − x2·s, x2·c + x1·s), -1), x1 and x2 the halves of x (gpt-oss's `_apply_rotary_emb` with half-width
    tables c, s: NeoX's rotation with cat(c, c) and cat(s, s)) -> (x, c, s)."""
    parts = _cat_pair(node)
    if parts is None:
        return None
    first, second = _binary(parts[0], {operator.sub, torch.sub}, "sub"), _binary(parts[1], _ADD, "add")
    if first is None or second is None:
        return None
    plus, minus = first  # x1·c − x2·s
    for x1 in (plus.args if isinstance(plus, fx.Node) else ()):
        lo = _half_of(x1)
        if lo is None or lo[1] != "lo":
            continue
        x, c = lo[0], _product(plus, x1)
        for x2 in (minus.args if isinstance(minus, fx.Node) else ()):
            if _half_of(x2) != (x, "hi"):
                continue
            s = _product(minus, x2)
            if not isinstance(c, fx.Node) or not isinstance(s, fx.Node):
                continue
            cos_term = [t for t in second if _product(t, x2) is c]  # x2·c
            sin_term = [t for t in second if _product(t, x1) is s]  # x1·s
            if cos_term and sin_term and cos_term[0] is not sin_term[0]:
                return x, c, s
    return None


def _anchor_complex(node: fx.Node):
    """view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * f).flatten(-2): the complex spelling (Meta's
    llama, torchtitan, HF Llama-4), GPT-J's interleaved rotation with f = cos + i·sin per pair -> (x, f)."""
    if not _is(node, {torch.flatten}, "flatten"):
        return None
    real, tn = node.args[0], _tensor(node)
    tr = _tensor(real)
    if tr is None or tn is None or not _is(real, {torch.view_as_real}) or tr.shape[-1] != 2:
        return None
    if not (_dim_is_last(_arg(node, 1, "start_dim", 0), tr.dim(), 1) and _dim_is_last(_arg(node, 2, "end_dim", -1), tr.dim())):
        return None
    product = _binary(real.args[0], _MUL, "mul")
    if product is None:
        return None
    for cx, freqs in (product, product[::-1]):
        if not _is(cx, {torch.view_as_complex}) or not isinstance(freqs, fx.Node):
            continue
        pairs = cx.args[0]
        if not (_is(pairs, {torch.reshape}, "reshape") or _is(pairs, set(), "view")):
            continue
        x = pairs.args[0]
        tx, tp = _tensor(x), _tensor(pairs)
        if tx is None or tp is None or tp.dim() != tx.dim() + 1 or tuple(tp.shape[:-2]) != tuple(tx.shape[:-1]) \
                or tp.shape[-1] != 2:
            continue
        return upcast_source(x), freqs
    return None


def _partial_output(add: fx.Node, x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """x = X[..., :r] and cat([add, X[..., r:]], -1) uses the sum -> (X, cat)."""
    s = _last_slice(x)
    if s is None:
        return None
    base, start, stop, step = s
    if start != 0 or step != 1:
        return None
    for user in add.users:
        if not _is(user, _CAT, "cat"):
            continue
        parts, dim = user.args[0], _arg(user, 1, "dim", 0)
        tu = _tensor(user)
        if tu is None or not isinstance(parts, (list, tuple)) or len(parts) != 2 or parts[0] is not add:
            continue
        if not _dim_is_last(dim, tu.dim()):
            continue
        rest = _last_slice(upcast_source(parts[1]))
        if rest is not None and rest[0] is base and rest[1] == stop and rest[2] == int(_tensor(base).shape[-1]) and rest[3] == 1:
            return base, user
    return None


def _reason(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, out: torch.Tensor | None, interleaved: bool,
            half: bool = False):
    """half: cos/sin hold each pair's angle once (gpt-oss's half-width tables), doubled for the op."""
    if cos is None or sin is None or out is None:
        return "no example values", None
    if cos.requires_grad or sin.requires_grad:
        return "cos/sin require grad (learned rotary tables; the kernel has no cos/sin gradient)", None
    for name, t in (("x", x), ("cos", cos)):
        if t.dtype not in rotary_ops.DTYPES:
            return f"{name} dtype {t.dtype}", None
    if sin.dtype != cos.dtype:
        return f"sin dtype {sin.dtype} differs from cos's {cos.dtype}", None
    if out.dtype != torch.promote_types(x.dtype, cos.dtype) or tuple(out.shape) != tuple(x.shape):
        return f"output {out.dtype} {tuple(out.shape)} is not x's {tuple(x.shape)} promoted with cos/sin's dtype", None
    if tuple(cos.shape) != tuple(sin.shape):
        return "cos and sin have different shapes", None
    if not 1 <= x.dim() <= 4 or cos.dim() > x.dim():
        return f"rank {x.dim()} input or cos of higher rank", None
    rd = cos.shape[-1] * (2 if half else 1)
    target = tuple(x.shape[:-1]) + (rd,)
    try:
        ok = torch.broadcast_shapes(tuple(cos.shape[:-1]) + (rd,), target) == target
    except RuntimeError:
        ok = False
    if not ok:
        return f"cos/sin {tuple(cos.shape)} do not broadcast to the rotary part {target}", None
    if rd % 2 or rd > x.shape[-1] or (interleaved and x.shape[-1] % 2):
        return f"rotary dim {rd} of head dim {x.shape[-1]}", None
    # The op's output layouts that equal the replaced output's: x's own (contiguous=False) and/or contiguous.
    flags = set()
    if out.stride() == torch.empty_like(x).stride():
        flags.add(False)
    if out.is_contiguous():
        flags.add(True)
    if not flags:
        return f"output strides {out.stride()} are neither x's layout nor contiguous", None
    return None, flags


def _same_value(a: Any, b: Any, depth: int = 6) -> bool:
    """a and b compute the same value: the same node, or the same pure op on the same inputs
    (GPT-J builds cos/sin once per q and once per k)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or depth == 0:
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and type(a) is type(b) and a == b
    if a.op != b.op or a.target != b.target or a.op not in ("call_function", "call_method") or len(a.args) != len(b.args):
        return False
    if set(a.kwargs) != set(b.kwargs):
        return False
    try:
        if a.is_impure():
            return False
    except TypeError:
        pass
    pairs = list(zip(a.args, b.args)) + [(a.kwargs[k], b.kwargs[k]) for k in a.kwargs]
    for x, y in pairs:
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if len(x) != len(y) or not all(_same_value(u, v, depth - 1) for u, v in zip(x, y)):
                return False
        elif not _same_value(x, y, depth - 1):
            return False
    return True


def _depends(node: fx.Node, on: fx.Node) -> bool:
    """Whether `node` is computed from `on`."""
    seen, work = set(), [node]
    while work:
        n = work.pop()
        if n is on:
            return True
        if n in seen:
            continue
        seen.add(n)
        work.extend(n.all_input_nodes)
    return False


def find(graph: fx.Graph, cfg: config.Config | None = None) -> Iterable[Match]:
    cfg = cfg or config.current()
    singles = []
    for node in list(graph.nodes):
        # tables: "full" (cos/sin over the rotary dims), "half" (each pair's angle once), "complex" (cos + i·sin)
        found, tables = _anchor(node), "full"
        if found is None and (halves := _anchor_halves(node)) is not None:
            found, tables = (*halves, False), "half"
        if found is None and (cx := _anchor_complex(node)) is not None:
            found, tables = (cx[0], cx[1], cx[1], True), "complex"
        if found is None:
            continue
        half = tables != "full"
        x, cos, sin, interleaved = found
        out = node
        partial = _partial_output(node, x) if not half else None
        if partial is not None:
            x, out = partial
        tx, tc, ts, to = _tensor(x), _tensor(cos), _tensor(sin), _tensor(out)
        if tx is None:
            continue
        if tables == "complex":  # the real and imaginary parts are the tables
            if tc is None or tc.dtype != torch.complex64 or tc.requires_grad:
                reason, flags = f"complex rotary factors of dtype {getattr(tc, 'dtype', None)}, or learned", None
                singles.append((x, cos, sin, interleaved, set(), out, reason, tx, None, tables))
                continue
            tc = ts = torch.view_as_real(tc)[..., 0]
        reason, flags = _reason(tx, tc, ts, to, interleaved, half)
        if reason is None and half and tc.shape[-1] * 2 != tx.shape[-1]:
            reason = "half-width cos/sin of a partial rotation"
        if reason is None and not half and partial is None and tc.shape[-1] != tx.shape[-1]:
            reason = "cos/sin cover fewer channels than x, without a pass-through concatenation"
        out_dtype = None
        if reason is None and (src := upcast_source(x)) is not x and _tensor(src) is not None:
            # x an exact upcast of 16-bit values (Cohere's q.float()): the kernel reads those and computes in fp32 as
            # well, so it reads them directly and writes the upcast's result dtype
            x, tx, out_dtype = src, _tensor(src), to.dtype
        if reason is None and (fused := fused_cast(out, rotary_ops.DTYPES)) is not None \
                and fused[1].itemsize < to.itemsize:  # a narrowing cast (a widening one is left to the reader)
            out, out_dtype = fused
        if reason is None and tx.device.type == "cuda" and not cfg.reference:
            dtype = out_dtype or to.dtype
            if not rotary_ops.kernel_supports(tx.dtype, tc.dtype, dtype):
                reason = f"no kernel for x {tx.dtype}, cos/sin {tc.dtype}, output {dtype}"
        singles.append((x, cos, sin, interleaved, flags or set(), out, reason, tx, out_dtype, tables))

    # q and k of one layer share cos/sin: one launch for both.
    used = set()
    for i, (x, cos, sin, inter, flags, out, reason, tx, out_dtype, tables) in enumerate(singles):
        if i in used:
            continue
        used.add(i)
        partner = None
        if reason is None:
            for j in range(i + 1, len(singles)):
                y = singles[j]
                if j in used or y[6] is not None or y[3] != inter or not (flags & y[4]) or y[8] != out_dtype \
                        or y[9] != tables:
                    continue
                if not (_same_value(y[1], cos) and _same_value(y[2], sin)):
                    continue
                ty = y[7]
                if _depends(y[0], out) or _depends(x, y[5]):  # one launch for both would form a cycle
                    continue
                if ty.dtype == tx.dtype and ty.dim() == tx.dim() and ty.shape[-1] == tx.shape[-1] and ty.device == tx.device:
                    partner = y
                    used.add(j)
                    break
        k, k_out = (partner[0], partner[5]) if partner else (None, None)
        if flags:
            common = flags & partner[4] if partner else flags
            contiguous = min(common)  # prefer x's own layout
        else:
            contiguous = False
        needs_grad = tx.requires_grad or (partner is not None and partner[7].requires_grad)
        yield Match(
            family=FAMILY,
            outputs=[out, k_out],
            target={"full": torch.ops.tk.rotary.default, "half": rotary_ops.rotary_half_tables,
                    "complex": rotary_ops.rotary_complex_tables}[tables],
            args=(x, k, cos, sin, inter, False, contiguous, out_dtype) if tables != "complex"
            else (x, k, cos, inter, False, contiguous, out_dtype),
            reason=reason,
            needs_grad=needs_grad,
            has_backward_kernel=True,
            device=tx.device,
        )
