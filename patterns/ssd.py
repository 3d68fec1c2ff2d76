"""Match Mamba-2's chunked SSD in a Dynamo (torch-IR) graph -> `tk::ssd`.

Anchored on the sum of the two output terms `Y_diag + Y_off`, then every piece of the chunked
algorithm is checked by walking back to the inputs:
- Y_diag = Σ_{s,n} C[b,c,l,h,n] B[b,c,s,h,n] L[b,h,c,l,s] X[b,c,s,h,p], L = exp(segsum(a))
- Y_off  = Σ_n C[b,c,l,h,n] S[b,c,h,p,n] exp(cumsum(a))[b,h,c,l]
- S = (Σ_z exp(segsum(pad(cumsum(a)[..., -1], (1, 0))))[b,h,c,z] T[b,z,h,p,n])[:, :-1], the last
  chunk being the final state, T = cat([h0 or zeros, states], 1),
  states = Σ_l B[b,c,l,h,n] exp(cumsum(a)[..., -1:] - cumsum(a))[b,h,c,l] X[b,c,l,h,p]
- X, B, C, a: the inputs zero-padded at the end of the sequence and reshaped into chunks, with
  X = x·dt, a = A·dt (the same dt), B/C repeat_interleave'd from groups to heads;
- then reshape back to (b, l_padded, h, p), `+ D[..., None] * pad(x)` (the same x), `[:, :l]`.
Contractions are read as index notation, so HF transformers' einsum chains (5.24), its
broadcast-multiply-and-sum chains (5.17 and 4.x) and mamba_ssm's `ssd_minimal_discrete`
(4-operand einsums) all match. Kept with a reason: unsupported dtypes, a padded output that is
never sliced back, anything that does not check out once the anchor is recognised.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.fx as fx

from tk_inductor.ops import ssd as _ops  # noqa: F401  (registers torch.ops.tk.ssd)
from tk_inductor import config
from tk_inductor.rewrite import Match, Squeeze, example

from ._fx import (arg, dtype, eq, is_tensor, is_zeros, kind, needs_grad, rank, scalar, shape,
                  shapes_eq, static_int, strip, through_upcasts)
from ._index import contraction, full_index, indexes, peel_to, unify
from ._decay import NoMatch as _NoMatch, need as _need, segsum_input as _segsum_input

FAMILY = "ssd"


def _last_keepdim(node, src) -> bool:
    """`node` is src[..., -1:], in one of its spellings: src[..., T - 1:], src[..., -1].unsqueeze(-1),
    src[..., -1, None], src.narrow(-1, -1 or T - 1, 1)."""
    if indexes(node, (Ellipsis, slice(-1, None))):
        return strip(node.args[0]) is src
    if kind(node) == "narrow" and shape(node.args[0]) is not None:
        rank, last = len(shape(node.args[0])), static_int(shape(node.args[0])[-1])
        dim, start, length = arg(node, 1, "dim"), static_int(arg(node, 2, "start")), static_int(arg(node, 3, "length"))
        return (isinstance(dim, int) and dim % rank == rank - 1 and length == 1 and last is not None
                and start is not None and start % last == last - 1 and strip(node.args[0]) is src)
    if kind(node) == "unsqueeze" and arg(node, 1, "dim") in (-1, len(shape(node)) - 1):
        inner = strip(node.args[0])
        return indexes(inner, (Ellipsis, -1)) and strip(inner.args[0]) is src
    index = node.args[1] if kind(node) == "getitem" else None
    if isinstance(index, tuple) and len(index) >= 2 and index[-1] is None and None not in index[:-1]:
        rank = len(shape(node.args[0]))
        full = full_index(index[:-1], rank)
        return full == full_index((Ellipsis, -1), rank) and strip(node.args[0]) is src
    return False


def _single_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


# ---------------------------------------------------------------------------- pieces

def _padded_seq(node, pad_right: int, dim: int = 1):
    """F.pad(t, ...) padding only dim `dim` at its end with zeros, by `pad_right` -> t (or node if no pad)."""
    node = strip(node)
    if kind(node) != "pad":
        _need(eq(pad_right, 0), "chunks: no padding where the length needs it")
        return node
    src, pads = node.args[0], arg(node, 1, "pad")
    mode, value = arg(node, 2, "mode", "constant"), arg(node, 3, "value", None)
    _need(mode == "constant" and (value is None or scalar(value) == 0.0), "chunks: padding not with zeros")
    nd = rank(src)
    for i in range(len(pads) // 2):
        left, right = pads[2 * i], pads[2 * i + 1]
        _need(eq(left, 0) and eq(right, pad_right if nd - 1 - i == dim else 0),
              "chunks: padding other than the sequence end")
    _need(eq(shape(node)[dim], shape(src)[dim] + pad_right), "chunks: padded length")
    return src


def _reshape_sizes(node):
    sizes = node.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = sizes[0]
    return list(sizes) or list(node.kwargs.get("shape", ()))


def _chunk_size(node, dim: int = 1):
    """The literal chunk length of a reshape splitting dim `dim` of its input into (-1 or n/chunk, chunk) (a symbolic
    length leaves the example shape as an unsimplified l_pad // (l_pad // chunk))."""
    node = strip(node)
    _need(kind(node) == "reshape" and len(_reshape_sizes(node)) >= dim + 2, "chunks: not a reshape")
    chunk = static_int(_reshape_sizes(node)[dim + 1])
    _need(chunk is not None and chunk > 0, "symbolic chunk size")
    return chunk


def _chunks(node, chunk: int, length: int, dim: int = 1):
    """reshape(pad(t), (..., -1 or n/chunk, chunk, ...)), dim `dim` (the sequence) of t split into chunks -> t, whose
    dim `dim` has size `length` (the padding, if any, at its end)."""
    node = strip(node)
    _need(_chunk_size(node, dim) == chunk, "chunks: chunk sizes differ")
    padded = node.args[0]
    s = shape(padded)
    sizes = _reshape_sizes(node)
    _need(len(sizes) == len(s) + 1 and all(eq(a, b) for a, b in zip(sizes[:dim], s[:dim]))
          and (static_int(sizes[dim]) == -1 or eq(sizes[dim], s[dim] // chunk))
          and all(eq(a, b) for a, b in zip(sizes[dim + 2:], s[dim + 1:])), "chunks: reshape shape")
    src = _padded_seq(padded, s[dim] - length, dim)
    _need(eq(shape(src)[dim], length), "chunks: source length")
    return src


def _a_chunks(node, chunk: int, length: int):
    """The (b, h, c, chunk) chunks of A·dt -> A·dt, (b, l, h): chunked along l and permuted (0, 3, 1, 2), or made
    (b, h, l) first (transpose(1, 2) or permute(0, 2, 1)) and chunked along its last dim."""
    if kind(node) == "permute" and tuple(node.args[1:] if len(node.args) > 2 else node.args[1]) == (0, 3, 1, 2):
        return _chunks(node.args[0], chunk, length)
    src = strip(_chunks(node, chunk, length, dim=2))
    dims = tuple(src.args[1:] if len(src.args) > 2 else src.args[1]) if kind(src) == "permute" else None
    _need(rank(src) == 3 and (dims == (0, 2, 1) or (
        kind(src) == "transpose" and {arg(src, 1, "dim0") % 3, arg(src, 2, "dim1") % 3} == {1, 2})), "dt·A layout")
    return src.args[0]


def _discretised(node, what: str):
    """t * dt (dt possibly [..., None] and upcast) -> (t, dt) with dt of shape (b, l, h)."""
    node = strip(node)
    _need(kind(node) == "mul" and is_tensor(node.args[0]) and is_tensor(node.args[1]), f"{what} is not a product with dt")
    for t, d in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        d = through_upcasts(d)
        if kind(d) == "getitem" or kind(d) == "unsqueeze":
            d = peel_to(d, "blhx", "blh")
            if d is None:
                continue
            d = through_upcasts(d)
        if shape(t) is not None and 1 < len(shape(t)) < 4 and all(eq(s, 1) for s in shape(t)[:-1]):
            t = peel_to(t, "xyz"[:len(shape(t)) - 1] + "h", "h") or t  # A[None, None, :]: A
        if shape(d) is not None and len(shape(d)) == 3 and shape(t) is not None and (
                len(shape(t)) == 4 or len(shape(t)) == 1):
            return t, d
    raise _NoMatch(f"{what}: no dt factor")


def _heads_from_groups(node, heads: int):
    """repeat_interleave(G, heads/groups, dim=2) (or G itself when groups == heads) -> G."""
    node = through_upcasts(node)
    if kind(node) == "repeat_interleave":
        src = through_upcasts(node.args[0])
        reps = example(arg(node, 1, "repeats"))  # one count for every group (a tensor of counts is another layout)
        _need(arg(node, 2, "dim") in (2, -2) and isinstance(reps, (int, torch.SymInt)) and eq(shape(node)[2], heads),
              "B/C: repeat_interleave over heads")
        return src
    _need(eq(shape(node)[2], heads), "B/C: group count")
    return node


# ---------------------------------------------------------------------------- the walk

def _match(anchor, cfg: config.Config) -> Match | None:
    if kind(anchor) != "add" or not (is_tensor(anchor.args[0]) and is_tensor(anchor.args[1])) or rank(anchor) != 5:
        return None
    for yd_node, yo_node in ((anchor.args[0], anchor.args[1]), (anchor.args[1], anchor.args[0])):
        diag = unify(contraction(yd_node), [("C", "bclhn"), ("B", "bcshn"), ("L", "bhcls"), ("X", "bcshp")], "bclhp")
        if diag is not None and contraction(yd_node).scale == 1.0:
            break
    else:
        return None
    # The intra-chunk decay is the distinctive part: from here on a failure is a kept match.
    try:
        a = _segsum_input(diag["L"])
    except _NoMatch:
        return None
    try:
        return _verify(anchor, yd_node, yo_node, diag, a, cfg)
    except _NoMatch as why:
        return Match(family=FAMILY, outputs=[anchor], reason=f"SSD-like subgraph not provably Mamba-2 SSD ({why})")


def _verify(anchor, yd_node, yo_node, diag, a, cfg: config.Config) -> Match:
    Cc, Bc, Xc = diag["C"], diag["B"], diag["X"]
    b, nc, _, h, p = shape(Xc)
    n = shape(Bc)[-1]
    chunk = _chunk_size(Xc)
    _need(shapes_eq(shape(a), (b, h, nc, shape(Xc)[2])), "dt·A chunks shape")
    off_c = contraction(yo_node)
    off = unify(off_c, [("C", "bclhn"), ("S", "bchpn"), ("E", "bhcl")], "bclhp", bound={"C": Cc})
    _need(off is not None and off_c.scale == 1.0, "Y_off is not C·states·exp(cumsum)")
    acum = strip(off["E"])
    _need(kind(acum) == "exp", "state decay is not exp(cumsum)")
    acum = strip(acum.args[0])
    _need(kind(acum) == "cumsum" and arg(acum, 1, "dim") % 4 == 3 and strip(acum.args[0]) is a, "cumsum of dt·A")

    # chunk-start states: new_states[:, :-1], new_states = Σ_z decay_chunk · cat([h0, states])
    starts = strip(off["S"])
    _need(indexes(starts, (slice(None), slice(None, -1))), "chunk-start states")
    new_states = strip(starts.args[0])
    ns_c = contraction(new_states)
    inter = unify(ns_c, [("DC", "bhts"), ("T", "bshpn")], "bthpn")
    _need(inter is not None and ns_c.scale == 1.0, "inter-chunk recurrence")
    padded_last = _segsum_input(inter["DC"])
    _need(kind(padded_last) == "pad" and tuple(arg(padded_last, 1, "pad")) == (1, 0)
          and scalar(arg(padded_last, 3, "value", 0) or 0) == 0.0, "chunk decays not padded by one")
    last = strip(padded_last.args[0])
    _need(indexes(last, (Ellipsis, -1)) and strip(last.args[0]) is acum, "chunk decays are not cumsum[..., -1]")
    cat = strip(inter["T"])
    parts = arg(cat, 0, "tensors")
    _need(kind(cat) == "cat" and arg(cat, 1, "dim", 0) in (1, -4) and len(parts) == 2, "states concatenation")
    h0 = _initial_state(parts[0], (b, 1, h, p, n))
    states = strip(parts[1])
    st_c = contraction(states)
    intra = unify(st_c, [("B", "bclhn"), ("DS", "bhcl"), ("X", "bclhp")], "bchpn", bound={"B": Bc, "X": Xc})
    _need(intra is not None and st_c.scale == 1.0, "chunk states")
    ds = strip(intra["DS"])
    _need(kind(ds) == "exp" and kind(strip(ds.args[0])) == "sub", "decay to chunk end")
    sub = strip(ds.args[0])
    tail = strip(sub.args[0])
    _need(strip(sub.args[1]) is acum and _last_keepdim(tail, acum), "decay to chunk end")

    # the inputs
    padded = shape(strip(Xc).args[0])[1]  # the padded length (nc·chunk, not simplified when symbolic)
    length = _output_length(anchor, b, padded, h, p)
    x_dt, dt_x = _discretised(_chunks(Xc, chunk, length), "x")
    A_node, dt_a = _discretised(_a_chunks(strip(a), chunk, length), "A")
    _need(through_upcasts(dt_a) is through_upcasts(dt_x), "x and A discretised with different dt")
    _need(shapes_eq(shape(A_node), (h,)), "A per head")
    B_src = _heads_from_groups(_chunks(Bc, chunk, length), h)
    C_src = _heads_from_groups(_chunks(Cc, chunk, length), h)
    _need(shapes_eq(shape(B_src), shape(C_src)), "B and C groups differ")

    y_node, D = _output(anchor, b, padded, length, h, p, x_dt)
    final = next((u for u in new_states.users if indexes(u, (slice(None), -1))), None)
    x_arg = strip(x_dt)
    tensors = [x_arg, through_upcasts(dt_x), through_upcasts(A_node), B_src, C_src, D, h0]
    examples = [example(t.node if isinstance(t, Squeeze) else t) for t in tensors if t is not None]
    return Match(
        family=FAMILY,
        outputs=[y_node, final],
        target=torch.ops.tk.ssd.default,
        args=(x_arg, through_upcasts(dt_x), through_upcasts(A_node), B_src, C_src, D, h0, int(chunk)),
        reason=_kept_reason(examples, x_arg, y_node, final, shape(B_src)[-1], cfg),
        # the output's example value knows whether grad mode was on (parameters' alone do not)
        needs_grad=needs_grad(y_node),
        has_backward_kernel=_ops.BACKWARD_KERNEL_VALIDATED,  # the backward kernels, once validated on the GPU
        # without them: HF Mamba2's broadcast-multiply-and-sum chains: Inductor makes slow kernels of them, and the reference's
        # batched autograd trained HF Mamba2 4.0x faster (H200, benchmarks/RESULTS.md); einsum
        # spellings compile to matmuls that beat it (0.3-0.6x at the op), so those keep Inductor in training
        reference_backward_faster=kind(strip(yd_node)) == "sum",
        device=examples[0].device,
        # the op keeps the state in fp32; a recurrence computed in 16 bits returned it in 16 bits
        output_dtypes={1: torch.float32} if final is not None and dtype(final) != torch.float32 else {},
    )


def _kept_reason(examples, x, y, final, n, cfg: config.Config) -> str | None:
    """Why a proven SSD keeps its code (examples: the op's tensor arguments' values), or None."""
    if any(e.dtype not in (torch.float32, torch.bfloat16, torch.float16) for e in examples):
        return f"dtypes {sorted({str(e.dtype) for e in examples})}"
    if dtype(y) != dtype(x):
        return f"output dtype {dtype(y)} differs from x's {dtype(x)}"
    if final is not None and dtype(final) not in (torch.float32, torch.bfloat16, torch.float16):
        return f"final state dtype {dtype(final)}"
    if examples[0].device.type == "cuda" and not cfg.reference:
        return _ops.kernel_supports(n, shape(x)[-1])
    return None


def _initial_state(node, expected_shape):
    """zeros / zeros_like (no initial state) -> None; h0[:, None] (upcast) -> h0; any other T0 -> T0.squeeze(1)."""
    node = strip(node)
    _need(shapes_eq(shape(node), expected_shape), "initial state shape")
    if is_zeros(node):
        return None
    node = through_upcasts(node)
    h0 = peel_to(node, "bxhpn", "bhpn")
    # any other (b, 1, h, p, n) tensor (made in another graph, at a graph break): the op takes it squeezed
    return through_upcasts(h0) if h0 is not None else Squeeze(node, 1)


def _output_length(anchor, b, padded, h, p) -> int:
    """The true sequence length: the [:, :l] slice after the reshape (or the padded length)."""
    node = anchor
    for _ in range(4):
        user = _single_user(node)
        if user is None:
            break
        if kind(user) == "getitem" and isinstance(user.args[1], tuple) and len(user.args[1]) == 2 \
                and user.args[1][0] == slice(None) and isinstance(user.args[1][1], slice):
            sl = user.args[1][1]
            if sl.start in (None, 0) and sl.step in (None, 1) and sl.stop is not None and len(shape(user)) == 4:
                return shape(user)[1]
        node = user
    return padded


def _output(anchor, b, padded, length, h, p, x_f):
    """Walk Y_diag + Y_off forward: reshape to (b, l_pad, h, p), + D·x, [:, :l] -> (y node, D)."""
    node = anchor
    user = _single_user(node)
    if user is not None and kind(user) == "contiguous":
        node, user = user, _single_user(user)
    _need(user is not None and kind(user) == "reshape" and shapes_eq(shape(user), (b, padded, h, p)), "output reshape")
    node, D = user, None
    user = _single_user(node)
    if user is not None and kind(user) == "add" and is_tensor(user.args[0]) and is_tensor(user.args[1]):
        other = user.args[1] if user.args[0] is node else user.args[0]
        other = strip(other)
        if kind(other) == "mul":
            for d, xp in ((other.args[0], other.args[1]), (other.args[1], other.args[0])):
                if not (is_tensor(d) and is_tensor(xp)):
                    continue
                d = peel_to(d, "hp", "h")
                if d is not None and strip(_padded_seq(xp, padded - length)) is strip(x_f) \
                        and shapes_eq(shape(user), shape(node)):
                    D = through_upcasts(d)
                    node = user
                    break
    if not eq(length, padded):
        user = _single_user(node)
        _need(user is not None and kind(user) == "getitem" and shapes_eq(shape(user), (b, length, h, p)),
              "padded output not sliced")
        node = user
    return node, D


# The recurrence's matcher reads with this module's pieces (_need, _heads_from_groups, _kept_reason): it is
# imported once they exist.
from . import _ssd_recurrent  # noqa: E402


def find(graph: fx.Graph, cfg: config.Config | None = None) -> Iterable[Match]:
    """The chunked SSD (anchored on Y_diag + Y_off) and the token-by-token recurrence (on the stack or cat of the
    tokens' outputs, _ssd_recurrent.py)."""
    cfg = cfg or config.current()
    matches = []
    for node in list(graph.nodes):
        if kind(node) not in ("add", "stack", "cat"):
            continue
        try:
            m = _match(node, cfg) if kind(node) == "add" else _ssd_recurrent.match(node, cfg)
        except (_NoMatch, TypeError, IndexError, AttributeError, KeyError, ValueError, RuntimeError):
            m = None  # not SSD (or not one we can read)
        if m is not None:
            matches.append(m)
    return matches
