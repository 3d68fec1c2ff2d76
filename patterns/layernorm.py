"""Matcher for residual + dropout + LayerNorm / RMSNorm on the Dynamo (torch-IR) graph -> `tk::layernorm`.

The norm (the anchor), then what feeds it:

* LayerNorm: `F.layer_norm(h, (H,), w, b, eps)` / `torch.layer_norm` (nn.LayerNorm inlines to it),
  with or without affine parameters.
* RMSNorm: `F.rms_norm(h, (H,), w, eps)` / `torch.rms_norm`; and the written-out form of HF
  LlamaRMSNorm / T5LayerNorm and friends: `a = h.to(float32)` (or `.float()`, or no cast),
  `var = a.pow(2).mean(-1, keepdim=True)` (or `a * a`, `torch.square`, `torch.mean`),
  `a * torch.rsqrt(var + eps)` (or h times it: T5), an optional cast back
  (`.to(dtype)` / `.type_as`), then an optional `weight * ...` in either order.
* LayerNorm written out (Cohere's CohereLayerNorm, hand-written ones): `c = a - a.mean(-1, keepdim=True)`, then
  `c * rsqrt(var + eps)` or `c / sqrt(var + eps)` with var the biased variance (`c.pow(2).mean(-1, keepdim=True)`
  or `a.var(-1, keepdim=True, unbiased=False)`), a = h or its cast; then weight and bias as for the functional form.
* What feeds h: `h = residual + dropout(x)` (either operand order, `operator.add`, `torch.add`,
  `Tensor.add`; GPT-2's `attn_output + residual`, BERT's `LayerNorm(dropout(dense(x)) + input)`,
  Llama's `residual + hidden_states`), `h = dropout(x)`, or a plain input. Dropout is
  `F.dropout` / `torch.dropout` / `nn.Dropout`: p > 0 in training becomes the op's Philox dropout
  (same distribution, mask regenerated in the backward; the RNG stream differs from torch's).
  Or the gated product `h = x.float() * F.silu(z.float())` of Mamba-2's MambaRMSNormGated (the op's
  gate), computed in fp32; with one group, its `(..., 1, size)` view of h and the view back are
  dropped. Several groups (n_groups > 1, a weight row per group) are kept.

Dtypes, as eager gives them: the residual add may promote (an fp32 residual stream plus a bf16
branch output under autocast gives an fp32 h: the narrower operand is the op's x), the weight may
have another dtype than the activations (fp32 weights on bf16 rows, Gemma's `(1 + w.float())`), and
the output has the dtype of the matched output node. An exact upcast of the norm's input (autocast's
cast in front of an fp32 norm) is read from its source, and a cast that is the output's only use is
fused into the op's output dtype.

eps may be a run-time value: `dynamic=True` passes float attributes as graph inputs, read with
`.item()` as a symbolic float. A replaced norm takes its value as a constant, guarded (a new eps
recompiles): Dynamo specialises a symbolic float that reaches a custom op anyway, restarting its
analysis of the frame once, so a run-time eps argument would buy nothing.

Kept, with the reason: normalisation over several trailing dims, weight/bias not (H,), hidden sizes
the kernels do not take (multiple of 8 up to 16384), dtypes other than fp32/fp16/bf16, dtype
combinations the kernels do not take (kernel mode on CUDA), in-place dropout, p >= 1, and statistics
whose form differs from the op's (mean over another dim, no keepdim, other powers). An add whose
operands differ in shape (a broadcast bias) is not a residual: the norm is matched alone with h as
its input.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F

from tk_inductor import config
from tk_inductor.ops import layernorm as layernorm_ops
from tk_inductor.rewrite import Match, example

from ._fx import arg as _arg, fused_cast, is_call as _is, tensor as _tensor, upcast_source

FAMILY = "layernorm"

_ADD = {operator.add, torch.add, operator.iadd}
_MUL = {operator.mul, torch.mul}
_LAYER_NORM = {F.layer_norm, torch.layer_norm}
_RMS_NORM = {getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)} - {None}
_DROPOUT = {F.dropout, torch.dropout}
_RSQRT = {torch.rsqrt}
_MEAN = {torch.mean}
_POW = {torch.pow, operator.pow}
_SQUARE = {torch.square}
_SUB = {operator.sub, torch.sub}
_DIV = {operator.truediv, torch.div}
_SQRT = {torch.sqrt}
_VAR = {torch.var}


def _number(x: Any) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return None


def _last_dim(dim: Any, rank: int) -> bool:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, rank - 1)


# ---------------------------------------------------------------------------- casts

_FLOAT_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}


def _cast_source(node: Any) -> fx.Node | None:
    """`node` is a dtype cast (`.to(dtype)`, `.float()`, `.type_as(t)`, `.type(dtype)`): its input."""
    if not isinstance(node, fx.Node) or node.op != "call_method":
        return None
    if node.target in ("to", "type", "type_as") or node.target in _FLOAT_METHODS:
        src = node.args[0]
        out, inp = _tensor(node), _tensor(src)
        if out is None or inp is None or tuple(out.shape) != tuple(inp.shape) or out.device != inp.device:
            return None
        return src
    return None


def _strip_casts(node: Any) -> Any:
    while (src := _cast_source(node)) is not None:
        node = src
    return node


# ---------------------------------------------------------------------------- RMSNorm written out

def _square_of(node: Any) -> fx.Node | None:
    if _is(node, _POW, "pow") and _number(_arg(node, 1, "exponent")) == 2.0:
        return node.args[0]
    if _is(node, _SQUARE, "square"):
        return node.args[0]
    if _is(node, _MUL, "mul") and len(node.args) == 2 and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _scalar_add(node: Any) -> tuple[fx.Node, float | fx.Node] | None:
    """`t + eps` in either order: (t, eps)."""
    if not _is(node, _ADD, "add") or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and _number(b) is not None:
        return a, _number(b)
    if isinstance(b, fx.Node) and _number(a) is not None:
        return b, _number(a)
    # A scalar only known at run time (dynamic=True turns float attributes into `t.item()`):
    # still the norm, so that the report can say why it is kept.
    for t, eps in ((a, b), (b, a)):
        if _tensor(t) is not None and isinstance(eps, fx.Node) and _tensor(eps) is None:
            return t, eps
    return None


def _last_dim_mean(node: Any, of: Any) -> bool:
    """node = mean(of, -1, keepdim=True) (`torch.mean` / `Tensor.mean`, no dtype)."""
    t = _tensor(of)
    return (_is(node, _MEAN, "mean") and node.args[0] is of and t is not None
            and _last_dim(_arg(node, 1, "dim"), t.dim()) and _arg(node, 2, "keepdim", False) is True
            and _arg(node, 3, "dtype") is None)


def _rms_rsqrt(node: Any) -> tuple[fx.Node, float] | None:
    """rsqrt(mean(a², -1, keepdim=True) + eps) -> (a, eps), a with its casts stripped."""
    if not _is(node, _RSQRT, "rsqrt"):
        return None
    inner = _scalar_add(node.args[0])
    if inner is None:
        return None
    mean, eps = inner
    if not _is(mean, _MEAN, "mean") or not _last_dim_mean(mean, mean.args[0]):
        return None
    a = _square_of(mean.args[0])
    return (_strip_casts(a), eps) if a is not None and _tensor(a) is not None else None


def _mul_operands(node: Any) -> tuple[Any, Any] | None:
    if _is(node, _MUL, "mul") and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


# ---------------------------------------------------------------------------- the pass

class _Norm:
    """A recognised norm: input h, output node, parameters."""

    def __init__(self, h, out, weight, bias, eps, rms):
        self.h, self.out, self.weight, self.bias, self.eps, self.rms = h, out, weight, bias, eps, rms


def _hidden_vector(node: Any, h: fx.Node) -> bool:
    t, th = _tensor(node), _tensor(h)
    return t is not None and th is not None and t.dim() == 1 and t.shape[0] == th.shape[-1]


def _affine_after(out: fx.Node, h: fx.Node, bias_ok: bool) -> tuple[fx.Node, Any, Any]:
    """A norm without its own weight, followed by an optional cast back, then `* w` and (LayerNorm) `+ b` of (H,)
    vectors, each the single user of the step before (so the chain is the norm's): (output, weight, bias)."""
    weight = bias = None
    nxt = _single_user(out)
    if nxt is not None and _cast_source(nxt) is out:
        out, nxt = nxt, _single_user(nxt)
    wm = _mul_operands(nxt) if nxt is not None else None
    if wm is not None:
        other = wm[1] if wm[0] is out else wm[0]
        if _hidden_vector(other, h):
            weight, out = other, nxt
            nxt = _single_user(out)
            if bias_ok and nxt is not None and _is(nxt, _ADD, "add") and len(nxt.args) == 2 and not nxt.kwargs:
                other = nxt.args[1] if nxt.args[0] is out else nxt.args[0]
                if _hidden_vector(other, h):
                    bias, out = other, nxt
    return out, weight, bias


def _functional_norm(node: fx.Node) -> _Norm | None:
    if _is(node, _LAYER_NORM):
        h, shape = node.args[0], _arg(node, 1, "normalized_shape")
        norm = _Norm(h, node, _arg(node, 2, "weight"), _arg(node, 3, "bias"), _arg(node, 4, "eps", 1e-5), False)
    elif _is(node, _RMS_NORM):
        h, shape = node.args[0], _arg(node, 1, "normalized_shape")
        eps = _arg(node, 3, "eps")
        if eps is None:  # F.rms_norm's default: the input dtype's machine epsilon
            th = _tensor(h)
            eps = torch.finfo(th.dtype).eps if th is not None else None
        norm = _Norm(h, node, _arg(node, 2, "weight"), None, eps, True)
    else:
        return None
    if norm.weight is None and norm.bias is None and isinstance(h, fx.Node):  # `norm(h) * w (+ b)` written apart
        norm.out, norm.weight, norm.bias = _affine_after(node, h, bias_ok=not norm.rms)
    return norm, shape


def _written_rms(mul: fx.Node) -> _Norm | None:
    """`b * rsqrt(...)` (b = a or the uncast h), then optional cast and weight multiply."""
    ops = _mul_operands(mul)
    if ops is None:
        return None
    for b, r in (ops, ops[::-1]):
        found = _rms_rsqrt(r)
        if found is None:
            continue
        h, eps = found
        if _strip_casts(b) is not h:
            continue
        out, weight, _ = _affine_after(mul, h, bias_ok=False)
        return _Norm(h, out, weight, None, eps, True)
    return None


def _centred(node: Any) -> fx.Node | None:
    """node = a - mean(a, -1, keepdim=True) -> a."""
    if not _is(node, _SUB, "sub") or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, m = node.args
    return a if isinstance(a, fx.Node) and _last_dim_mean(m, a) else None


def _biased_variance(node: Any, a: fx.Node) -> bool:
    """node = the biased variance of a over the last dim, kept: mean((a - mean(a))², -1, keepdim=True), or
    `var(a, -1, keepdim=True)` with `unbiased=False` / `correction=0` given by keyword."""
    if _is(node, _MEAN, "mean"):
        sq = _square_of(node.args[0])
        return sq is not None and _centred(sq) is a and _last_dim_mean(node, node.args[0])
    if not _is(node, _VAR, "var") or node.args[0] is not a or len(node.args) > 2:
        return False
    t, kw = _tensor(a), node.kwargs
    biased = kw.get("unbiased", True) is False or kw.get("correction", 1) == 0
    return (t is not None and biased and kw.get("keepdim") is True
            and _last_dim(node.args[1] if len(node.args) == 2 else kw.get("dim"), t.dim()))


def _written_layer_norm(node: fx.Node) -> _Norm | None:
    """`(a - mean) * rsqrt(var + eps)` or `(a - mean) / sqrt(var + eps)`, var the biased variance of a (Cohere's
    CohereLayerNorm, hand-written LayerNorms), then optional cast, weight and bias; a is h with its casts."""
    if _is(node, _MUL, "mul"):
        pairs = [(c, r.args[0]) for c, r in (node.args, node.args[::-1]) if _is(r, _RSQRT, "rsqrt")]
    elif _is(node, _DIV, "div") and _is(node.args[1], _SQRT, "sqrt") and not node.kwargs:
        pairs = [(node.args[0], node.args[1].args[0])]
    else:
        return None
    for c, inner in pairs:
        a = _centred(c)
        added = _scalar_add(inner) if a is not None else None
        if added is None or not _biased_variance(added[0], a):
            continue
        h = _strip_casts(a)
        out, weight, bias = _affine_after(node, h, bias_ok=True)
        return _Norm(h, out, weight, bias, added[1], False)
    return None


def _single_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _dropout(node: Any) -> tuple[fx.Node, float, bool, str | None] | None:
    """dropout(x, p, training) -> (x, p_effective, inplace, reason)."""
    if not isinstance(node, fx.Node):
        return None
    if _is(node, {F.dropout}):
        p, training, inplace = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True), _arg(node, 3, "inplace", False)
    elif _is(node, {torch.dropout}):
        p, training, inplace = _arg(node, 1, "p"), _arg(node, 2, "train"), False
    else:
        return None
    if not isinstance(training, bool) or _number(p) is None:
        return node.args[0], 0.0, inplace, "dropout p/training not constant"
    p = float(p) if training else 0.0
    reason = None
    if inplace:
        reason = "in-place dropout"
    elif p >= 1.0:
        reason = "dropout p >= 1"
    return node.args[0], p, inplace, reason


def _same_tensor_kind(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and a.device == b.device


def _operand_of(t: torch.Tensor | None, h: torch.Tensor) -> bool:
    """t can be an operand of h = a + b: h's shape and device, a floating dtype h's promotes from."""
    return (t is not None and tuple(t.shape) == tuple(h.shape) and t.device == h.device and t.is_floating_point()
            and torch.promote_types(t.dtype, h.dtype) == h.dtype)


def _feed(h: fx.Node) -> tuple[fx.Node, fx.Node | None, float, fx.Node | None, str | None]:
    """Decompose h = residual + dropout(x): (x, residual, p, h_node_to_reroute, reason). With operands of two dtypes
    (an fp32 residual stream plus a bf16 branch) x is the narrower, whose dtype the sum promotes."""
    th = _tensor(h)
    if _is(h, _ADD, "add") and len(h.args) == 2 and h.kwargs.get("alpha", 1) == 1 and h.target is not operator.iadd:
        a, b = h.args
        ta, tb = _tensor(a), _tensor(b)
        if _operand_of(ta, th) and _operand_of(tb, th) and th.dtype in (ta.dtype, tb.dtype):
            da, db = _dropout(a), _dropout(b)
            if db is not None and da is None:
                a, b, da = b, a, db
            if da is not None:
                x, p, _, reason = da
                if _same_tensor_kind(_tensor(x), _tensor(a)) and _tensor(b).dtype == th.dtype:
                    return x, b, p, h, reason
                return h, None, 0.0, None, None  # dropout of the wider operand: the norm alone
            if _tensor(a).dtype != th.dtype:  # the residual carries h's dtype
                return a, b, 0.0, h, None
            return (b, a, 0.0, h, None) if _tensor(b).dtype != th.dtype else (a, b, 0.0, h, None)
    d = _dropout(h)
    if d is not None:
        x, p, _, reason = d
        if _same_tensor_kind(_tensor(x), th):
            return x, None, p, h, reason
    return h, None, 0.0, None, None


def _eps_ok(eps: Any) -> bool:
    """A constant, or a node holding a symbolic float (a float attribute under dynamic=True)."""
    if isinstance(eps, (int, float)) and not isinstance(eps, bool):
        return True
    return isinstance(eps, fx.Node) and isinstance(example(eps), torch.SymFloat)


def _check(norm: _Norm, shape, x, residual, out_dtype: torch.dtype, cfg: config.Config, gate=None) -> str | None:
    th = _tensor(norm.h)
    if th is None:
        return "no example value for the norm input"
    if shape is not None:
        dims = list(shape) if isinstance(shape, (list, tuple, torch.Size)) else [shape]
        if len(dims) != 1 or dims[0] != th.shape[-1]:
            return f"normalised over {len(dims)} trailing dims (the op normalises the last one)"
    if not _eps_ok(norm.eps):
        return f"eps is neither a constant nor a symbolic float ({norm.eps!r})"
    tx = _tensor(x)
    for name, t in (("activations", th), ("x", tx), ("gate", _tensor(gate) if gate is not None else th)):
        if t is None or t.dtype not in layernorm_ops.DTYPES:
            return f"{name} dtype {getattr(t, 'dtype', None)}"
    hidden = th.shape[-1]
    # A symbolic hidden size (dynamic=True) is checked as a guard: a size the kernels do not take recompiles.
    if not isinstance(hidden, (int, torch.SymInt)) or hidden % 8 != 0 or hidden > layernorm_ops.MAX_HIDDEN:
        return f"hidden size {hidden} (kernels take multiples of 8 up to {layernorm_ops.MAX_HIDDEN})"
    dtypes = set()
    for name, t in (("weight", norm.weight), ("bias", norm.bias)):
        if t is None:
            continue
        tt = _tensor(t)
        if tt is None or tt.dim() != 1 or tt.shape[0] != hidden:
            return f"{name} is not a ({hidden},) tensor"
        if tt.dtype not in layernorm_ops.DTYPES:
            return f"{name} dtype {tt.dtype}"
        dtypes.add(tt.dtype)
    if len(dtypes) > 1:
        return "weight and bias have different dtypes"
    out = _tensor(norm.out)
    if out is None or tuple(out.shape) != tuple(th.shape) or out_dtype not in layernorm_ops.DTYPES:
        return f"output {getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))} is not a float tensor of h's shape"
    if tx.device.type == "cuda" and not cfg.reference:
        w = next(iter(dtypes)) if dtypes else None
        if gate is not None and not layernorm_ops.gate_supported(w, out_dtype):
            return f"no gated kernel for weight {w}, output {out_dtype}"
        if gate is None and not layernorm_ops.kernel_supports(tx.dtype, th.dtype, w, out_dtype):
            return f"no kernel for x {tx.dtype}, h {th.dtype}, weight {w}, output {out_dtype}"
    return None


_SILU = {F.silu}


def _view_source(node: Any) -> fx.Node | None:
    if _is(node, {torch.reshape}, "view") or _is(node, {torch.reshape}, "reshape"):
        return node.args[0]
    return None


def _ungroup(norm: _Norm) -> None:
    """A norm over a view of g that keeps g's last dim, whose output is viewed back to g's shape, is the norm of g
    (HF's MambaRMSNormGated with one group normalises a (..., 1, size) view): h becomes g, the output the view back
    or the weight multiply after it."""
    g = _view_source(norm.h)
    tg, th = _tensor(g), _tensor(norm.h)
    if tg is None or th is None or norm.weight is not None or norm.bias is not None or tg.shape[-1] != th.shape[-1]:
        return
    back = _single_user(norm.out)
    tb = _tensor(back) if back is not None else None
    if _view_source(back) is not norm.out or tb is None or tuple(tb.shape) != tuple(tg.shape):
        return
    norm.h = g
    norm.out, norm.weight, norm.bias = _affine_after(back, g, bias_ok=not norm.rms)


def _gate(h: Any) -> tuple[fx.Node, fx.Node] | str | None:
    """h = x * silu(z) in fp32 (Mamba-2's gated RMSNorm, MambaRMSNormGated): (x, z) with exact upcasts stripped (the
    kernel reads them in their own dtypes and computes the product in fp32). A reason where h is a gated product in
    another form; None where it is none."""
    src = _view_source(h)
    ops = _mul_operands(src if src is not None else h)
    if ops is None:
        return None
    for a, s in (ops, ops[::-1]):
        if not _is(_strip_casts(s), _SILU, "silu"):
            continue
        if src is not None:  # groups of the last dim (n_groups > 1): each row would need its slice of the weight
            return "grouped gated norm (x * silu(z) normalised in groups of the last dim): the op takes one weight row"
        silu = s
        while (t := _tensor(silu)) is not None and t.dtype == torch.float32 and _cast_source(silu) is not None:
            silu = _cast_source(silu)  # casts that keep fp32
        th, ts = _tensor(h), _tensor(silu)
        if not _is(silu, _SILU, "silu") or ts is None or ts.dtype != torch.float32 or _arg(silu, 1, "inplace", False):
            return f"gated norm with silu(z) computed in {getattr(ts, 'dtype', None)} (the kernel computes it in fp32)"
        if th is None or th.dtype != torch.float32:
            return f"gated norm with x * silu(z) computed in {getattr(th, 'dtype', None)} (the kernel computes it in fp32)"
        x, z = upcast_source(a), upcast_source(silu.args[0])
        tx, tz = _tensor(x), _tensor(z)
        if tx is None or tz is None or tuple(tx.shape) != tuple(th.shape) or tuple(tz.shape) != tuple(th.shape):
            return "gated norm whose x or gate broadcasts"
        return x, z
    return None


def find(graph: fx.Graph, cfg: config.Config | None = None) -> Iterable[Match]:
    cfg = cfg or config.current()
    for node in list(graph.nodes):
        shape = None
        found = _functional_norm(node)
        if found is not None:
            norm, shape = found
        else:
            norm = _written_rms(node) or _written_layer_norm(node)
        if norm is None:
            continue
        if not isinstance(norm.h, fx.Node):
            continue
        _ungroup(norm)
        x, residual, p, h_node, reason = _feed(norm.h)
        gate = None
        if residual is None and p == 0.0:
            h_node = None  # the op returns no h then (h == x); an eval-mode dropout node stays for its other users
            gated = _gate(x)
            if isinstance(gated, str):
                reason = reason or gated
            elif gated is not None:
                x, gate = gated
            else:
                x = upcast_source(x)  # the kernel reads a 16-bit input and upcasts it, exactly as the cast does
        out_dtype = getattr(_tensor(norm.out), "dtype", None)
        if reason is None and (fused := fused_cast(norm.out, layernorm_ops.DTYPES)) is not None:
            norm.out, out_dtype = fused
        reason = reason or _check(norm, shape, x, residual, out_dtype, cfg, gate)
        tx = _tensor(x)
        needs_grad = any(
            (t := _tensor(n)) is not None and t.requires_grad
            for n in (x, residual, norm.weight, norm.bias, gate) if n is not None
        )
        eps = norm.eps
        if isinstance(eps, fx.Node):  # a symbolic float: specialised (guarded) only where the norm is replaced
            eps = float(example(eps)) if reason is None else 0.0
        yield Match(
            family=FAMILY,
            outputs=[norm.out, h_node, None, None, None],
            target=torch.ops.tk.layernorm.default,
            # stats: keep mean/rstd only where a backward can run (grad mode on, a differentiable input needs grad);
            # Dynamo guards grad mode and requires_grad, so a graph compiled without them recompiles with them.
            args=(x, residual, norm.weight, norm.bias, None, float(eps), p, norm.rms, needs_grad and torch.is_grad_enabled(),
                  out_dtype, gate),
            reason=reason,
            needs_grad=needs_grad,
            has_backward_kernel=True,
            device=tx.device if tx is not None else None,
        )
