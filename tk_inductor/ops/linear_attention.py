"""`tk::linear_attention`: causal linear attention with the feature map as an op argument.

Semantics (q, k: (B, H, N, dk); v: (B, H, N, dv); output (B, H, N, dv), contiguous, v's dtype):

    o_i = Σ_{j≤i} κ(q_i, k_j) v_j                      (normalize=False)
    o_i = Σ_{j≤i} κ(q_i, k_j) v_j / (Σ_{j≤i} κ(q_i, k_j) + eps)   (normalize=True)

with the kernel κ fixed by `feature_map`:

- "identity": κ = scale · q·k
- "elu1":     κ = scale · φ(q)·φ(k),  φ(x) = elu(x) + 1
- "hedgehog": κ = scale · φ_q(q)·φ_k(k),  φ_W(x) = cat(softmax(x W), softmax(-x W)) over the last dim;
              W is `q_weight` / `k_weight`, per head (H, dk, f) or shared (dk, f)
- "based":    κ = 1 + s + s²/2 with s = scale · q·k (2nd-order Taylor of exp), i.e.
              φ(scale·q)·φ(k) with φ(x) = cat([1, x, vec(x⊗x)/√2]).

How this lines up with flash-linear-attention (where they overlap the semantics are exactly theirs):
- `fla.ops.based.parallel_based(q, k, v, scale, use_norm)` is "based" with the same `scale`
  (default dk^-½) and eps=1e-6 (FLA layout is (B, N, H, d); ours is head-first).
- The Based paper's `TaylorFeatureMap` spelling `cat([1, x/d^¼, vec(x⊗x)/(√2·√d)])` applied to q and k
  gives 1 + q·k/√d + (q·k)²/(2d): "based" with scale = d^-½.
- `fla.ops.linear_attn.chunk_linear_attn(q, k, v, scale, normalize)` on feature-mapped q, k is
  "identity" with the same scale; its normaliser divides by (scale·q)·cumsum(k) + 1e-10, i.e. eps=1e-10.
  `fla.layers.LinearAttention(feature_map="elu")` maps with elu(x)+1 first: "elu1".
- FLA's `HedgehogFeatureMap` is *not* "hedgehog": it applies one softmax over cat([2xW+b, -(2xW+b)])
  (a single normaliser, with a bias). Ours is the Hedgehog paper's two separate softmaxes without
  bias; the matcher leaves FLA's spelling alone.

Autograd: the forward saves its inputs and output; `tk::linear_attention_backward` returns (dq, dk, dv, dq_weight,
dk_weight) (weight grads are empty tensors when there is no weight) and recomputes the forward's running state
inside, chunk by chunk, as the Based backward kernel does. Hedgehog's backward on the GPU is the identity map's on
features recomputed by a kernel of the map's own, whose backward kernel then gives dq, dk and the weights' dz.
The reference is a chunked scan in fp32 (chunk 64): intra-chunk masked products plus an fp32 running
state — the same algorithm a kernel with the state in registers runs, never an N×N matrix.
Non-finite inputs: in the reference a NaN/inf at position t reaches only outputs from t on. The CUDA kernel keeps
that across its 64-position tiles; inside a tile it can reach earlier outputs through the masked tile product,
as in FLA's chunked kernels.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _dispatch

FAMILY = "linear_attention"
FEATURE_MAPS = ("identity", "elu1", "based", "hedgehog")
REFERENCE_CHUNK = 64

# The CUDA kernels (csrc/kernels/linear_attention): Based (based.cu, the forward; based_backward.cu with based_dq.cuh
# and based_dkdv.cuh, the backward) with dk 16, and the plain maps identity and elu1 (plain.cu; plain_backward.cu with
# plain_dq.cuh and plain_dkdv.cuh) with dk 64 or 128; Hedgehog's forward (hedgehog.cu) with dk 64 or 128 and 32 or 64
# projections (64 or 128 features), its backward the identity kernel's on the features between the map's own kernels
# (hedgehog_map.cu, `_hedgehog_grads`); bf16, dv a multiple of 64.
KERNEL_DK = {"based": (16,), "identity": (64, 128), "elu1": (64, 128), "hedgehog": (64, 128)}
HEDGEHOG_PROJECTIONS = (32, 64)
KERNEL_DV_TILE = 64
# The backward kernels are validated on the GPU by tests/linear_attention/test_linear_attention_gpu.py. False: the
# backward op and the matcher fall back to the reference (what to set while a changed kernel awaits its GPU run).
BACKWARD_KERNEL_VALIDATED = True


def kernel_supports(feature_map: str, dtype: torch.dtype, dk, dv, projections=None) -> str | None:
    """None if a CUDA kernel computes this case, else why not (also used by the matcher). `projections`: the weights'
    last size (Hedgehog's f), None without weights."""
    if feature_map not in KERNEL_DK or (projections is not None) != (feature_map == "hedgehog"):
        return f"feature map {feature_map!r} (the kernels implement {', '.join(map(repr, KERNEL_DK))}; weights only " \
               f"with 'hedgehog')"
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (the linear-attention kernels take bfloat16)"
    if dk not in KERNEL_DK[feature_map]:
        dims = " or ".join(map(str, KERNEL_DK[feature_map]))
        return f"feature dim {dk} (the {feature_map!r} kernel takes {dims})"
    if feature_map == "hedgehog" and projections not in HEDGEHOG_PROJECTIONS:
        return f"{projections} Hedgehog projections (the kernel takes {' or '.join(map(str, HEDGEHOG_PROJECTIONS))})"
    if not isinstance(dv, int) or dv <= 0 or dv % KERNEL_DV_TILE:
        return f"value dim {dv} (the kernels take multiples of {KERNEL_DV_TILE})"
    return None


def _projections(q_weight):
    return None if q_weight is None else q_weight.shape[-1]


# ---------------------------------------------------------------------------- validation

def _validate(q, k, v, feature_map, q_weight, k_weight, scale, eps) -> None:
    check = _dispatch.check
    _dispatch.check_operands("tk::linear_attention", "B, H, N, d", q=q, k=k, v=v)
    check(q.shape == k.shape,
          lambda: f"tk::linear_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    check(v.shape[:3] == q.shape[:3],
          lambda: f"tk::linear_attention: v {tuple(v.shape)} must share (B, H, N) with q {tuple(q.shape)}")
    check(feature_map in FEATURE_MAPS,
          lambda: f"tk::linear_attention: feature_map {feature_map!r} not in {FEATURE_MAPS}")
    check(math.isfinite(scale), lambda: f"tk::linear_attention: scale must be finite, got {scale}")
    check(eps >= 0 and math.isfinite(eps), lambda: f"tk::linear_attention: eps must be finite and >= 0, got {eps}")
    if feature_map != "hedgehog":
        check(q_weight is None and k_weight is None,
              lambda: f"tk::linear_attention: feature map {feature_map!r} takes no weights (only 'hedgehog' does)")
        return
    H, dk = q.shape[1], q.shape[3]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check(isinstance(w, torch.Tensor),
              lambda: f"tk::linear_attention: 'hedgehog' needs {name} (a tensor)", TypeError)
        check(w.dim() in (2, 3) and (w.dim() == 2 or w.shape[0] == H) and w.shape[-2] == dk,
              lambda: f"tk::linear_attention: {name} must be (H={H}, dk={dk}, f) or (dk={dk}, f), got {tuple(w.shape)}")
        check(w.dtype in _dispatch.FLOATS,
              lambda: f"tk::linear_attention: {name} dtype {w.dtype} is not a float type", TypeError)
        check(w.device == q.device, lambda: f"tk::linear_attention: {name} is on {w.device}, q on {q.device}")
    check(q_weight.shape[-1] == k_weight.shape[-1],
          lambda: f"tk::linear_attention: q_weight and k_weight feature sizes differ "
                  f"({q_weight.shape[-1]} vs {k_weight.shape[-1]})")


# ---------------------------------------------------------------------------- reference

def _hedgehog(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    z = torch.einsum("bhnd,hdf->bhnf", x, w) if w.dim() == 3 else x @ w
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


def _taylor(x: torch.Tensor) -> torch.Tensor:
    outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0)
    return torch.cat([torch.ones_like(x[..., :1]), x, outer], dim=-1)


def feature_maps(q, k, feature_map: str, q_weight=None, k_weight=None, scale: float = 1.0):
    """(φ̃q, φk) in fp32 (fp64 for fp64 inputs) with κ(q_i, k_j) = φ̃q_i · φk_j (scale folded into q)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(acc), k.to(acc)
    if feature_map == "identity":
        return q * scale, k
    if feature_map == "elu1":
        return (F.elu(q) + 1) * scale, F.elu(k) + 1
    if feature_map == "hedgehog":
        return _hedgehog(q, q_weight.to(acc)) * scale, _hedgehog(k, k_weight.to(acc))
    return _taylor(q * scale), _taylor(k)


def linear_attention_reference(q, k, v, feature_map, q_weight=None, k_weight=None, scale=1.0,
                               normalize=False, eps=0.0, chunk: int = REFERENCE_CHUNK) -> torch.Tensor:
    """Chunked causal scan in fp32 (differentiable; the backward reference is its autograd)."""
    # Non-finite inputs reach only later positions (_dispatch.nan_from): k and v enter the state, q one output.
    feeds = ~(k.isfinite().all(-1) & v.isfinite().all(-1))  # (B, H, N)
    reads = ~q.isfinite().all(-1)  # (B, H, N)
    q, k, v = q.masked_fill(reads[..., None], 0.0), k.masked_fill(feeds[..., None], 0.0), \
        v.masked_fill(feeds[..., None], 0.0)
    fq, fk = feature_maps(q, k, feature_map, q_weight, k_weight, scale)
    v32 = v.to(fq.dtype)
    if normalize:  # the denominator is the same scan with a column of ones as the value
        v32 = torch.cat([v32, torch.ones_like(v32[..., :1])], dim=-1)
    B, H, N, F_ = fq.shape
    pad = (-N) % chunk  # zero keys and values at the end: they add nothing to any state
    nc = (N + pad) // chunk

    def chunks(t):
        return F.pad(t, (0, 0, 0, pad)).reshape(B, H, nc, chunk, t.shape[-1])

    qc, kc, vc = chunks(fq), chunks(fk), chunks(v32)
    # batched over chunks (no loop: the backward runs this as its autograd): the state before each chunk is the
    # sum of the earlier chunks' φ(k)ᵀv, an exclusive cumulative sum
    kv = kc.transpose(-1, -2) @ vc  # (B, H, c, F, dv): each chunk's own contribution
    before = F.pad(kv.cumsum(dim=2)[:, :, :-1], (0, 0, 0, 0, 1, 0))
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    scores = (qc @ kc.transpose(-1, -2)).masked_fill(~causal, 0.0)
    o = (scores @ vc + qc @ before).reshape(B, H, nc * chunk, -1)[:, :, :N]
    if normalize:
        o = o[..., :-1] / (o[..., -1:] + eps)
    o = o + _dispatch.nan_from(feeds, reads, -1, o.dtype)[..., None]
    return o.to(v.dtype).contiguous()


# ---------------------------------------------------------------------------- the ops

# Explicit schemas: the contract `tk_cuda::` kernels register verbatim.
SCHEMA = ("(Tensor q, Tensor k, Tensor v, str feature_map, Tensor? q_weight=None, Tensor? k_weight=None, "
          "float scale=1.0, bool? normalize=False, float eps=0.0) -> Tensor")
BACKWARD_SCHEMA = ("(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, str feature_map, Tensor? q_weight, "
                   "Tensor? k_weight, float scale, bool? normalize, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("tk::linear_attention", mutates_args=(), schema=SCHEMA)
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
                     q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                     scale: float = 1.0, normalize: bool = False, eps: float = 0.0) -> torch.Tensor:
    _dispatch.check_flags("tk::linear_attention", normalize=normalize)
    _validate(q, k, v, feature_map, q_weight, k_weight, scale, eps)
    if q.numel() == 0 or v.numel() == 0:  # no positions, heads or batch entries (or empty features): nothing to sum
        return v.new_zeros(v.shape)
    if kernel_supports(feature_map, q.dtype, q.shape[-1], v.shape[-1], _projections(q_weight)) is None \
            and _dispatch.use_kernel(FAMILY, q, k, v, *(w for w in (q_weight, k_weight) if w is not None)):
        return _dispatch.kernel("linear_attention")(q, k, v, feature_map, q_weight, k_weight, scale, normalize, eps)
    return linear_attention_reference(q, k, v, feature_map, q_weight, k_weight, scale, normalize, eps)


@linear_attention.register_fake
def _(q, k, v, feature_map, q_weight=None, k_weight=None, scale=1.0, normalize=False, eps=0.0):
    _dispatch.check_flags("tk::linear_attention", normalize=normalize)
    _validate(q, k, v, feature_map, q_weight, k_weight, scale, eps)
    return v.new_empty(v.shape)  # contiguous (B, H, N, dv)


@torch.library.custom_op("tk::linear_attention_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def linear_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              o: torch.Tensor, feature_map: str, q_weight: torch.Tensor | None,
                              k_weight: torch.Tensor | None, scale: float, normalize: bool, eps: float
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dq_weight, dk_weight); weight grads are empty tensors without weights. o is the forward's
    output (the kernel's denominator gradient needs do·o over whole rows)."""
    _dispatch.check_flags("tk::linear_attention_backward", normalize=normalize)
    _validate(q, k, v, feature_map, q_weight, k_weight, scale, eps)
    _dispatch.check_grad("tk::linear_attention_backward", "grad_o", grad_o, v.shape, "v's shape")
    if q.numel() == 0 or v.numel() == 0:
        dw = [q.new_zeros(0) if w is None else torch.zeros_like(w) for w in (q_weight, k_weight)]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dw[0], dw[1]
    if BACKWARD_KERNEL_VALIDATED \
            and kernel_supports(feature_map, q.dtype, q.shape[-1], v.shape[-1], _projections(q_weight)) is None \
            and _dispatch.use_kernel(FAMILY, grad_o, q, k, v, o) and _dispatch.has_kernel("linear_attention_backward"):
        if feature_map == "hedgehog":
            return _hedgehog_grads(grad_o, q, k, v, o, q_weight, k_weight, scale, normalize, eps)
        return _dispatch.kernel("linear_attention_backward")(grad_o, q, k, v, o, feature_map, q_weight, k_weight,
                                                            scale, normalize, eps)
    return _reference_grads(grad_o, q, k, v, feature_map, q_weight, k_weight, scale, normalize, eps)


def _hedgehog_grads(grad_o, q, k, v, o, q_weight, k_weight, scale, normalize, eps):
    """Hedgehog's gradients on the kernels: linear attention is the identity map's on the features (φq, φk), so the
    features are recomputed (tk_cuda::hedgehog_features), the 'identity' backward kernel gives (dφq, dφk, dv), and
    the map's backward kernel takes dφ back to q and k and to dz, the gradient of x W, whose weight gradient is
    Σ xᵀ dz over the rows (a matmul)."""
    features, back = _dispatch.kernel("hedgehog_features"), _dispatch.kernel("hedgehog_features_backward")
    dfq, dfk, dv, _, _ = _dispatch.kernel("linear_attention_backward")(
        grad_o, features(q, q_weight), features(k, k_weight), v, o, "identity", None, None, scale, normalize, eps)
    (dq, dzq), (dk, dzk) = back(dfq, q, q_weight), back(dfk, k, k_weight)
    return dq, dk, dv, _weight_grad(q, dzq, q_weight), _weight_grad(k, dzk, k_weight)


def _weight_grad(x, dz, w):
    return torch.einsum("bhnd,bhnf->hdf" if w.dim() == 3 else "bhnd,bhnf->df", x, dz).to(w.dtype)


def _reference_grads(grad_o, q, k, v, feature_map, q_weight, k_weight, scale, normalize, eps):
    """The reference's gradients, (dq, dk, dv, dq_weight, dk_weight), weight gradients empty without weights."""
    grads = _dispatch.reference_vjp(
        lambda q_, k_, v_, wq, wk: linear_attention_reference(q_, k_, v_, feature_map, wq, wk, scale, normalize, eps),
        (q, k, v, q_weight, k_weight), (grad_o,))
    return tuple(q.new_empty(0) if t is None else t for t in grads)


@linear_attention_backward.register_fake
def _(grad_o, q, k, v, o, feature_map, q_weight, k_weight, scale, normalize, eps):
    dw = [q.new_empty(0) if w is None else w.new_empty(w.shape) for w in (q_weight, k_weight)]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dw[0], dw[1]


def _setup_context(ctx, inputs, output):
    q, k, v, feature_map, q_weight, k_weight, scale, normalize, eps = inputs
    ctx.save_for_backward(q, k, v, output, q_weight, k_weight)
    ctx.options = (feature_map, scale, normalize, eps)


def _backward(ctx, grad_o):
    q, k, v, o, q_weight, k_weight = ctx.saved_tensors
    feature_map, scale, normalize, eps = ctx.options
    dq, dk, dv, dqw, dkw = torch.ops.tk.linear_attention_backward(
        grad_o.contiguous(), q, k, v, o, feature_map, q_weight, k_weight, scale, normalize, eps)
    return (dq, dk, dv, None,
            dqw if q_weight is not None else None, dkw if k_weight is not None else None,
            None, None, None)


linear_attention.register_autograd(_backward, setup_context=_setup_context)
