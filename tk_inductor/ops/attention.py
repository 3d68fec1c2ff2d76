"""`tk::attention` and `tk::attention_backward`: softmax attention with fp32 statistics.

Semantics (the CUDA kernels in csrc/kernels/attention implement `tk_cuda::` ops with the same schemas):

    tk::attention(q, k, v, causal, scale, window=0, softcap=0., dropout_p=0., rng=None) -> (o, lse)
        q and k (B, Hq, N, D), (B, Hkv, M, D), v (B, Hkv, M, Dv) (Dv may differ from D: MLA's 192 / 128, run by the
        kernels zero-padded to the larger), Hq % Hkv == 0 (GQA: query head h reads kv head h // (Hq/Hkv),
        as `repeat_interleave` / SDPA `enable_gqa=True`), any strides with stride(-1) == 1.
        s = scale · q kᵀ; with softcap > 0, s = softcap · tanh(s / softcap) (Gemma-2's score capping);
        masked to key j <= query i when `causal` (top-left aligned, SDPA `is_causal=True`, also for N != M: every
        row sees key 0, so no row is empty), and with window > 0 (needs causal) also to j > i - window: each query
        sees itself and the window - 1 keys before it, the sliding window of transformers' masks (Mistral, Gemma-2,
        Qwen2; FlashAttention's window_size=(window - 1, 0)). A row left with no key (only when N > M + window - 1)
        gets o = 0 and lse = +inf, as SDPA's safe softmax gives (and the backward's P = 0);
        lse = logsumexp(s) over keys, fp32 (B, Hq, N) contiguous, natural log;
        o = softmax(s) v in q's dtype, shape (B, Hq, N, Dv), a view of a (B, N, Hq, Dv) contiguous buffer
        (what FlashAttention returns: the usual `o.transpose(1, 2).reshape(B, N, Hq * Dv)` is then free).
        With dropout_p > 0 (training), o = (softmax(s) ∘ keep / (1 - dropout_p)) v, keep the Philox mask of
        `rng`, a CPU int64 (seed, offset) pair (philox.draw_seed, or the graph's tk::philox_seed): a pure function of
        the pair and the element (philox.attention_keep_mask, bit-identical to the kernels), so the backward
        regenerates it. lse stays that of the undropped scores.

    tk::attention_backward(grad_o, q, k, v, o, lse, causal, scale, window=0, softcap=0., dropout_p=0., rng=None,
                           grad_lse=None) -> (dq, dk, dv)
        shapes and dtypes of q, k, v, each laid out as `grad_like` its input: (B, N, H, D) memory order when the
        input's heads lie inside its sequence dim (HF's transposed projections: the projections' backward then reads
        the gradient without a copy), contiguous otherwise; dk/dv summed over the query heads of each GQA group.
        Uses the forward's o and lse (FlashAttention's recipe: P = exp(s - lse), Δ = rowsum(do ∘ o)).

Kernel or reference: the op calls `torch.ops.tk_cuda.attention` when `_dispatch.use_kernel` allows it (CUDA
inputs, kernels built, not reference mode) *and* the kernel covers the inputs (bf16/fp16, head dim 32, 64, 80,
96, 128, 192 or 256, see `kernel_supports`); otherwise the fp32-accumulating PyTorch
reference below, on any device and any float dtype. The matcher (patterns/attention.py) only routes supported shapes
to the op in kernel mode, so the reference fallback there is for direct calls and reference mode.

`lse` is differentiable too (d lse / d s = P, so its gradient enters the backward as rowsum(grad_o ∘ o) - grad_lse):
attention sinks (gpt-oss) rescale o by a function of lse.

The ops on masks whose values are known only at run time live beside this one: `tk::attention_masked`
(attention_masked.py) and `tk::attention_varlen` (attention_varlen.py).
"""
from __future__ import annotations

import math

import torch

from . import _dispatch, philox

FAMILY = "attention"
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# The kernels run any head dim that is a multiple of 8 up to 256 (zero-filled to the next of 64, 128, 192, 256 in the
# forward, of 64, 128, 256 in the backward). The op routes them those measured on the H200 (benchmarks/RESULTS.md): 32
# (small models), 80 (Phi-2), 96 (Phi-3) at 0.99-1.11x cuDNN, 64 and 128; 192 (0.98-1.09x cuDNN forward) and 256
# (Gemma, Gemma-2 2B/9B: 0.90-0.97x cuDNN forward at 1-2k tokens, 0.99-1.09x from 4k; 1.65-2.19x SDPA's flash
# backend; 3.8x FlexAttention with Gemma-2's softcap, which SDPA lacks). Forward+backward at 256: 0.92-0.97x cuDNN and
# 1.40-1.55x flash, at 192 (the D = 256 backward, zero-filled) 0.81-0.90x cuDNN and 1.10-1.27x flash; SDPA's default
# order runs flash there, so training graphs are routed too.
KERNEL_HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
BACKWARD_HEAD_DIMS = KERNEL_HEAD_DIMS
# Queries of at most this many rows run the split-KV decode kernels (kDecodeRows in csrc/kernels/attention). Against
# SDPA's own split-KV path (no mask, K/V heads not repeated) they ran 0.87-1.00x cuDNN on the H200, so the matcher
# leaves such decode steps to SDPA; a masked step (SDPA on repeated K/V, the memory-efficient kernel) or an eager one is
# replaced (benchmarks/RESULTS.md).
DECODE_ROWS = 16
# Dropout (training) runs on the forward's ping-pong kernels and the D = 64 and 128 backward kernels
# (kMaxDropoutHeadDim in csrc/kernels/attention/attention.h), with a positive scale and without a softcap.
DROPOUT_MAX_HEAD_DIM = 128


def kernel_supports(dtype: torch.dtype, head_dim, backward: bool = False, dropout: bool = False) -> str | None:
    """None if the CUDA kernels handle this dtype and head dim (and with `backward`, also its gradients; with
    `dropout`, dropout), else why not (also used by the matcher)."""
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (the attention kernels take bfloat16/float16)"
    if not isinstance(head_dim, int) or head_dim not in KERNEL_HEAD_DIMS:
        return f"head dim {head_dim} (the attention kernels take {' or '.join(map(str, KERNEL_HEAD_DIMS))})"
    if backward and head_dim not in BACKWARD_HEAD_DIMS:
        return (f"head dim {head_dim} in training (the backward kernels take "
                f"{' or '.join(map(str, BACKWARD_HEAD_DIMS))})")
    if dropout and head_dim > DROPOUT_MAX_HEAD_DIM:
        return f"dropout at head dim {head_dim} (the dropout kernels take head dims up to {DROPOUT_MAX_HEAD_DIM})"
    return None


# ---------------------------------------------------------------------------- validation

def _validate_scores(causal, window, softcap, op: str, dropout_p=0.0, rng=None, two_sided: bool = False) -> None:
    """two_sided: a window without causal is allowed (tk::attention_varlen's two-sided window)."""
    check = _dispatch.check
    check(isinstance(window, int) and not isinstance(window, bool) and window >= 0,
          lambda: f"{op}: window must be an int >= 0 (0: none), got {window!r}", TypeError)
    check(window == 0 or causal or two_sided, lambda: f"{op}: a sliding window (window={window}) needs causal=True")
    check(isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0,
          lambda: f"{op}: softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    check(isinstance(dropout_p, (int, float)) and 0 <= dropout_p < 1,
          lambda: f"{op}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    check(dropout_p == 0 or philox.is_rng(rng),
          lambda: f"{op}: dropout_p > 0 needs rng, a CPU int64 tensor (seed, offset) such as philox.draw_seed(), "
                  f"got {rng!r}")


def _validate(q, k, v, scale, op: str = "tk::attention", own_value_dim: bool = False) -> None:
    """own_value_dim: v's head dim may differ from q's and k's (tk::attention; its masked and variable-length
    siblings take one head dim)."""
    check = _dispatch.check
    _dispatch.check_operands(op, "B, H, N, D", q=q, k=k, v=v)
    if own_value_dim:
        check(k.shape[:3] == v.shape[:3],
              lambda: f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same (B, H, M)")
    else:
        check(k.shape == v.shape, lambda: f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    B, Hq, _, D = q.shape
    check(k.shape[0] == B, lambda: f"{op}: batch of k/v ({k.shape[0]}) differs from q's ({B})")
    check(k.shape[3] == D, lambda: f"{op}: head dim of k/v ({k.shape[3]}) differs from q's ({D})")
    check(D >= 1, lambda: f"{op}: the head dim must be at least 1, got q shape {tuple(q.shape)}")
    Hkv = k.shape[1]
    check(Hkv >= 1 and Hq % Hkv == 0, lambda: f"{op}: query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    check(k.shape[2] >= 1 or q.shape[2] == 0 or B == 0 or Hq == 0,
          lambda: f"{op}: keys must not be empty (softmax over zero keys is undefined), got k shape {tuple(k.shape)}")
    check(isinstance(scale, (int, float)) and math.isfinite(scale),
          lambda: f"{op}: scale must be a finite float, got {scale!r}",
          TypeError if not isinstance(scale, (int, float)) else ValueError)


def _validate_backward(grad_o, q, k, v, o, lse, scale, own_value_dim: bool = False) -> None:
    op = "tk::attention_backward"
    _validate(q, k, v, scale, op, own_value_dim)
    check = _dispatch.check
    for name, t in (("grad_o", grad_o), ("o", o), ("lse", lse)):
        check(isinstance(t, torch.Tensor), lambda: f"{op}: {name} must be a tensor, got {type(t).__name__}", TypeError)
        check(t.device == q.device, lambda: f"{op}: {name} is on {t.device}, q on {q.device}")
    o_shape = q.shape[:3] + v.shape[3:]
    for name, t in (("grad_o", grad_o), ("o", o)):
        check(t.shape == o_shape, lambda: f"{op}: {name} shape {tuple(t.shape)} must be (B, Hq, N, Dv) = {tuple(o_shape)}")
        check(t.dtype == q.dtype, lambda: f"{op}: {name} dtype {t.dtype} differs from q's {q.dtype}", TypeError)
    check(lse.shape == q.shape[:3],
          lambda: f"{op}: lse shape {tuple(lse.shape)} must be (B, Hq, N) = {tuple(q.shape[:3])}")
    check(lse.dtype == torch.float32, lambda: f"{op}: lse must be float32, got {lse.dtype}", TypeError)


# ---------------------------------------------------------------------------- reference

def causal_allowed(N: int, M: int, window: int, device) -> torch.Tensor:
    """(N, M) bool: key j visible from query i under the causal mask, j <= i (top-left), and with a window also
    j > i - window."""
    allowed = torch.ones(N, M, dtype=torch.bool, device=device).tril()
    return allowed.triu(1 - window) if window else allowed


def _scores(q, k, causal: bool, scale: float, mask: torch.Tensor | None = None, window: int = 0,
            softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 (fp64 for fp64 inputs) masked, scaled (and capped) scores (B, Hq, N, M), GQA by indexing as the kernel
    reads it, and with a softcap the derivative of the capped scores by the scaled ones, 1 - tanh², else None.
    `mask` (tk::attention_masked's SDPA path): bool (True = attend) or added to the scores, as SDPA's attn_mask."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(group, dim=1) if group > 1 else k.to(acc)
    s = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale
    dcap = None
    if softcap:
        t = torch.tanh(s / softcap)
        s, dcap = softcap * t, 1 - t * t
    if causal:
        s = s.masked_fill(~causal_allowed(q.shape[2], k.shape[2], window, q.device), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    return s, dcap


def grad_like(t: torch.Tensor) -> torch.Tensor:
    """An empty gradient for q, k or v in the layout the backward returns (the C++ binding's `grad_like`)."""
    _, H, N, _ = t.shape
    if H > 1 and N > 1 and t.stride(1) < t.stride(2):
        return _empty_out(t)
    return t.new_empty(t.shape)


def _as_grads(q, k, v, dq, dk, dv):
    """(dq, dk, dv) in `grad_like` layouts (copied where they are not)."""
    out = []
    for like, g in ((q, dq), (k, dk), (v, dv)):
        dst = grad_like(like)
        out.append(g if g.stride() == dst.stride() else dst.copy_(g))
    return tuple(out)


def _empty_out(q: torch.Tensor, d: int | None = None) -> torch.Tensor:
    """o for q: a (B, H, N, d) view of a (B, N, H, d) buffer, d q's head dim by default (else v's)."""
    B, H, N, D = q.shape
    return q.new_empty(B, N, H, D if d is None else d).transpose(1, 2)


def _lse(s: torch.Tensor) -> torch.Tensor:
    """logsumexp over keys, +inf on rows with every key hidden (the kernels' value: their backward's P = 0)."""
    lse = torch.logsumexp(s, dim=-1)
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _probs(s: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """P = exp(s - lse) from a forward's lse, or softmax(s) with None (exact also where every score is the same
    huge finite fill, whose logsumexp rounds); rows with every key hidden get 0 (SDPA's safe softmax)."""
    if lse is not None:
        return torch.exp(s - lse.to(s.dtype).unsqueeze(-1))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


def _keep(s: torch.Tensor, dropout_p: float, rng, head0: int = 0) -> torch.Tensor | None:
    """Dropout's keep mask over the (B, Hq, N, M) scores (philox.attention_keep_mask), None without dropout.
    head0: the stream's query head b * Hq + h of s's first head (a slice of a batch's entries)."""
    if not dropout_p:
        return None
    seed, offset = philox.unpack(rng)
    B, H, N, M = s.shape
    return philox.attention_keep_mask(B * H, N, M, seed, offset, dropout_p, s.device, head0).view(B, H, N, M)


def _drop(x: torch.Tensor, keep: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """x's kept elements scaled by 1 / (1 - p), the others zero (x without dropout)."""
    if keep is None:
        return x
    return torch.where(keep, x * philox.dropout_scale(dropout_p), torch.zeros((), dtype=x.dtype, device=x.device))


def attention_reference(q, k, v, causal: bool, scale: float, window: int = 0, softcap: float = 0.0, mask=None,
                        dropout_p: float = 0.0, rng=None, head0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) in the op's layout; accumulates in fp32. `mask`: see `_scores`; dropout by philox's mask (head0:
    see `_keep`)."""
    s, _ = _scores(q, k, causal, scale, mask, window, softcap)
    lse = _lse(s)
    group = q.shape[1] // k.shape[1]
    vf = v.to(s.dtype).repeat_interleave(group, dim=1) if group > 1 else v.to(s.dtype)
    p = _drop(_probs(s), _keep(s, dropout_p, rng, head0), dropout_p)
    o = _empty_out(q, v.shape[-1])
    o.copy_(torch.matmul(p, vf))
    return o, lse.to(torch.float32).contiguous()


def attention_backward_reference(grad_o, q, k, v, o, lse, causal: bool, scale: float, mask=None, window: int = 0,
                                 softcap: float = 0.0, dropout_p: float = 0.0, rng=None, head0: int = 0,
                                 grad_lse=None):
    """(dq, dk, dv) in `grad_like` layouts, from the forward's o and lse (None: P = softmax(s), see `_probs`); dk/dv
    summed over each GQA group. `mask`: see `_scores`; rows with every key hidden get no gradient. With dropout the
    forward's mask again (philox): dV takes the dropped P, dP is dropped the same way. grad_lse: the gradient of
    lse as well (d lse / d s = P: it enters as rowsum(grad_o * o) - grad_lse)."""
    s, dcap = _scores(q, k, causal, scale, mask, window, softcap)
    acc = s.dtype
    B, Hkv, M, _ = k.shape
    group = q.shape[1] // Hkv
    p = _probs(s, lse)
    do = grad_o.to(acc)
    kf = k.to(acc).repeat_interleave(group, dim=1) if group > 1 else k.to(acc)
    vf = v.to(acc).repeat_interleave(group, dim=1) if group > 1 else v.to(acc)
    keep = _keep(s, dropout_p, rng, head0)
    dv = torch.matmul(_drop(p, keep, dropout_p).transpose(-1, -2), do)
    dp = _drop(torch.matmul(do, vf.transpose(-1, -2)), keep, dropout_p)
    delta = (do * o.to(acc)).sum(-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc).unsqueeze(-1)
    ds = p * (dp - delta) * scale
    if dcap is not None:
        ds = ds * dcap
    dq = torch.matmul(ds, kf)
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
    if group > 1:  # sum the query heads of each group onto their kv head
        dk = dk.view(B, Hkv, group, M, k.shape[-1]).sum(2)
        dv = dv.view(B, Hkv, group, M, v.shape[-1]).sum(2)
    return _as_grads(q, k, v, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))


# ---------------------------------------------------------------------------- the ops

def _kernel_ok(*tensors, backward: bool = False, scale: float = 1.0, softcap: float = 0.0,
               dropout_p: float = 0.0) -> bool:
    """Whether the kernels run these operands (q first) and score function: dtype, head dim, and with dropout also
    scale > 0 and no softcap."""
    q, v = tensors[0], tensors[2]
    return (kernel_supports(q.dtype, max(q.shape[-1], v.shape[-1]), backward, dropout_p > 0) is None
            and (dropout_p == 0 or (scale > 0 and softcap == 0)) and _dispatch.use_kernel(FAMILY, *tensors))


def direct_kernel_ok(*tensors, backward: bool = False, scale: float = 1.0, softcap: float = 0.0,
                     dropout_p: float = 0.0) -> bool:
    """Whether the raw `tk_cuda::` op may stand in for the Python op (the post-grad pass asks with the node's fake
    values): the kernel takes the operands as they are, no empty-input shortcut and no copy of a strided row."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    # the raw ops take one head dim: the Python op pads q/k and v to a common one (_padded)
    same_dims = statically_known_true(tensors[0].shape[-1] == tensors[2].shape[-1])
    return same_dims and _kernel_ok(*tensors, backward=backward, scale=scale, softcap=softcap,
                                    dropout_p=dropout_p) and all(
        t.dim() < 4 or (statically_known_true(t.stride(-1) == 1) and statically_known_true(t.numel() > 0))
        for t in tensors)


def lse_grad(grad_lse, lse: torch.Tensor, op: str) -> torch.Tensor | None:
    """lse's gradient checked against lse's shape, as the raw backward takes it (fp32 contiguous), or None."""
    _dispatch.check(grad_lse is None or (isinstance(grad_lse, torch.Tensor) and grad_lse.shape == lse.shape),
                    lambda: f"{op}: grad_lse must have lse's shape {tuple(lse.shape)}")
    return None if grad_lse is None else grad_lse.float().contiguous()


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    # The kernels read rows with TMA: any strides, but the head dim must be packed.
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _padded(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors zero-padded to their largest head dim. The kernels take one head dim for q, k and v; zero columns
    of q and k leave the scores as they are (the scale is given), zero columns of v give zero columns of o (sliced
    off) and of dv, and zero columns of o and grad_o leave the backward's rowsum(grad_o ∘ o) as it is."""
    d = max(t.shape[-1] for t in tensors)
    return [t if t.shape[-1] == d else torch.nn.functional.pad(t, (0, d - t.shape[-1])) for t in tensors]


@torch.library.custom_op("tk::attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, bool? causal, float scale, int window=0, "
                                "float softcap=0., float dropout_p=0., Tensor? rng=None) -> (Tensor o, Tensor lse)")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, window: int = 0,
              softcap: float = 0.0, dropout_p: float = 0.0, rng: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    _dispatch.check_flags("tk::attention", causal=causal)
    _validate(q, k, v, scale, own_value_dim=True)
    _validate_scores(causal, window, softcap, "tk::attention", dropout_p, rng)
    if q.numel() == 0 or v.shape[-1] == 0:
        return _empty_out(q, v.shape[-1]), q.new_zeros(q.shape[:3], dtype=torch.float32)
    if _kernel_ok(q, k, v, scale=scale, softcap=softcap, dropout_p=dropout_p):
        q, k, v = map(_last_dim_unit, (q, k, v))
        if q.shape[-1] == v.shape[-1]:
            return _dispatch.kernel("attention")(q, k, v, causal, scale, window, softcap, dropout_p, rng)
        o, lse = _dispatch.kernel("attention")(*_padded(q, k, v), causal, scale, window, softcap, dropout_p, rng)
        return _empty_out(q, v.shape[-1]).copy_(o[..., :v.shape[-1]]), lse
    return attention_reference(q, k, v, causal, scale, window, softcap, None, dropout_p, rng)


@attention.register_fake
def _attention_fake(q, k, v, causal, scale, window=0, softcap=0.0, dropout_p=0.0, rng=None):
    _dispatch.check_flags("tk::attention", causal=causal)
    _validate(q, k, v, scale, own_value_dim=True)
    _validate_scores(causal, window, softcap, "tk::attention", dropout_p, rng)
    return _empty_out(q, v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tk::attention_backward", mutates_args=(),
                         schema="(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool? causal, "
                                "float scale, int window=0, float softcap=0., float dropout_p=0., Tensor? rng=None, "
                                "Tensor? grad_lse=None) -> (Tensor dq, Tensor dk, Tensor dv)")
def attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, causal: bool, scale: float, window: int = 0, softcap: float = 0.0,
                       dropout_p: float = 0.0, rng: torch.Tensor | None = None, grad_lse: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _dispatch.check_flags("tk::attention_backward", causal=causal)
    _validate_backward(grad_o, q, k, v, o, lse, scale, own_value_dim=True)
    g_lse = lse_grad(grad_lse, lse, "tk::attention_backward")
    _validate_scores(causal, window, softcap, "tk::attention_backward", dropout_p, rng)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return tuple(grad_like(t).zero_() for t in (q, k, v))
    if _kernel_ok(q, k, v, grad_o, o, lse, backward=True, scale=scale, softcap=softcap, dropout_p=dropout_p):
        grad_o, q, k, v, o = map(_last_dim_unit, (grad_o, q, k, v, o))
        if q.shape[-1] == v.shape[-1]:
            return _dispatch.kernel("attention_backward")(grad_o, q, k, v, o, lse.contiguous(), causal, scale, window,
                                                          softcap, dropout_p, rng, g_lse)
        gp, qp, kp, vp, op = _padded(grad_o, q, k, v, o)
        dq, dk, dv = _dispatch.kernel("attention_backward")(gp, qp, kp, vp, op, lse.contiguous(), causal, scale,
                                                            window, softcap, dropout_p, rng, g_lse)
        return _as_grads(q, k, v, dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]])
    return attention_backward_reference(grad_o, q, k, v, o, lse, causal, scale, None, window, softcap, dropout_p,
                                        rng, grad_lse=grad_lse)


@attention_backward.register_fake
def _attention_backward_fake(grad_o, q, k, v, o, lse, causal, scale, window=0, softcap=0.0, dropout_p=0.0, rng=None,
                             grad_lse=None):
    _dispatch.check_flags("tk::attention_backward", causal=causal)
    _validate_backward(grad_o, q, k, v, o, lse, scale, own_value_dim=True)
    _validate_scores(causal, window, softcap, "tk::attention_backward", dropout_p, rng)
    return grad_like(q), grad_like(k), grad_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, window, softcap, dropout_p, rng = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, rng)
    ctx.causal, ctx.scale, ctx.window, ctx.softcap, ctx.dropout_p = causal, scale, window, softcap, dropout_p
    ctx.set_materialize_grads(False)  # lse's gradient is None where lse is unused (no zeros to read)


def _backward(ctx, grad_o, grad_lse):
    q, k, v, o, lse, rng = ctx.saved_tensors
    if grad_o is None and grad_lse is None:
        return (None,) * 9
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv = torch.ops.tk.attention_backward(grad_o, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.window,
                                                 ctx.softcap, ctx.dropout_p, rng, grad_lse)
    return dq, dk, dv, None, None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)


def attention_adapter(q, k, v, causal: bool, scale: float, window: int, softcap: float, transposed: tuple, heads: str,
                      contiguous: bool = False, dropout_p: float = 0.0):
    """tk::attention for operands that need a layout change first (3-D batches, pre-transposed k...) or with dropout.

    `transposed` says which of q, k, v must be transposed back (last two dims); `heads` is "4d"
    (as is), "merged" (inputs were (B, H, ...) tensors, the output must be (B*H, N, D)) or
    "none" (3-D inputs without heads: a head axis of 1 is added and removed); `contiguous` returns
    a contiguous result, as the eager product was. dropout_p > 0: the (seed, offset) pair is drawn by a
    tk::philox_seed node, once per run of the graph."""
    q, k, v = (t.transpose(-1, -2) if tr else t for t, tr in zip((q, k, v), transposed))
    if heads == "none":
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    rng = torch.ops.tk.philox_seed() if dropout_p > 0 else None
    o = torch.ops.tk.attention(q, k, v, causal, scale, window, softcap, dropout_p, rng)[0]
    if heads == "none":
        o = o.squeeze(1)
    elif heads == "merged":
        o = o.flatten(0, 1)
    return o.contiguous() if contiguous else o


def attention_sink_adapter(q, k, v, causal: bool, scale: float, window: int, softcap: float, sink,
                           transposed: tuple, contiguous: bool = False, dropout_p: float = 0.0):
    """Attention with sinks (gpt-oss): softmax over the scores and one more logit per row, `sink` (broadcasting to
    (B, H, N, 1)), whose column is dropped. That is o·σ(lse − sink) with tk::attention's o and lse, differentiable in
    q, k, v (through the op's backward, lse's gradient included) and in the sinks. 4-D heads; `transposed` and
    `contiguous` as attention_adapter's. With dropout, the dropped probabilities are the sink-normalised ones, as
    eager drops them: the same factor."""
    q, k, v = (t.transpose(-1, -2) if tr else t for t, tr in zip((q, k, v), transposed))
    rng = torch.ops.tk.philox_seed() if dropout_p > 0 else None
    out = sink_rescale(*torch.ops.tk.attention(q, k, v, causal, scale, window, softcap, dropout_p, rng), sink)
    return out.contiguous() if contiguous else out


def sink_rescale(o, lse, sink):
    """o·σ(lse − sink): attention's o and lse with one more logit per row, `sink` (broadcasting to (B, H, N, 1)),
    in the softmax's denominator. A row that sees no key (lse = +inf) keeps o = 0: the sink takes all its mass."""
    kept = torch.sigmoid(lse - sink.to(lse.dtype).squeeze(-1))  # the share of the softmax's mass on the keys
    return (o * kept.unsqueeze(-1)).to(o.dtype)


from . import attention_masked, attention_varlen  # noqa: E402,F401  (register their ops)
