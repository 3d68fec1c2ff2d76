"""Gated linear attention with one decay per head and token (simple GLA) in its quadratic form -> `tk::simple_gla`:

    o = ((scale · q kᵀ) ∘ D) v,   D_ij = exp(G_i − G_j) for j ≤ i, 0 above,   G = cumsum(g) over the tokens

FLA's `naive_parallel_simple_gla` spelling (`(G[..., :, None] − G[..., None, :]).tril().exp().tril()`), the segsum
spellings that mask with -inf before the exp, and exp(Δ) made causal after it by tril / masked_fill / a causal 0-1
mask / where (patterns/_decay.py reads D); scores masked causal as well are read. q/k and v heads-first (B, H, N, d) or tokens-first (B, N, H, d), the
scores (B, H, N, N) and g (B, H, N). The op takes everything tokens-first (FLA's layout): heads-first operands are
handed over transposed and its output goes back transposed. Hooked into patterns/linear_attention.py (family
`linear_attention`), whose score and mask readers it is given.
"""
from __future__ import annotations

import torch

from tk_inductor.ops import simple_gla as _ops
from tk_inductor.ops import ssd as _ssd_ops
from tk_inductor import config
from tk_inductor.rewrite import Match, Transpose, example

from ._decay import NoMatch, decay_matrix
from ._fx import dtype, is_tensor, kind, needs_grad, rank, scaled, shape, shapes_eq, strip, through_upcasts
from ._index import heads_first

FAMILY = "linear_attention"


def match(out, M, v, lay_v: str, factor: float, cfg: config.Config, causal, scores) -> Match | None:
    """out = factor · M v (v and out in lay_v; patterns/linear_attention.py `_times_v`) with M the decayed scores: the
    simple GLA op's match, or None. causal(x) and scores(A) are patterns/linear_attention.py's `_causal` and
    `_scores`."""
    M, f = scaled(M)
    M = strip(M)
    if kind(M) != "mul" or not (is_tensor(M.args[0]) and is_tensor(M.args[1])) or rank(v) != 4:
        return None
    for A, D in ((M.args[0], M.args[1]), (M.args[1], M.args[0])):
        try:
            g = strip(decay_matrix(D, causal))
        except NoMatch:
            continue
        sc = scores(strip(causal(A) or A))  # (scores masked causal too: D masks them anyway)
        if sc is None or not shapes_eq(shape(g), shape(M)[:3]) or not shapes_eq(shape(A), shape(M)):
            continue
        q, k, scale, lay_q = sc
        # operands upcast to fp32 for the product (FLA's naive forms) go in at their own precision, which the kernels
        # compute in anyway; the op's output is then cast up to the result's dtype
        q, k, v = (through_upcasts(t) for t in (q, k, v))
        bhn = heads_first(shape(q), lay_q)[:3]
        if not shapes_eq(bhn, heads_first(shape(v), lay_v)[:3]) or not shapes_eq(bhn, shape(g)):
            return None
        return _make(out, q, k, v, g, factor * f * scale, lay_q, lay_v, cfg)
    return None


def _make(out, q, k, v, g, scale, lay_q: str, lay_v: str, cfg: config.Config) -> Match:
    examples = [example(t) for t in (q, k, v, g)]
    reason, output_dtypes = None, {}
    dtypes = {e.dtype for e in examples[:3]}
    if len(dtypes) != 1:
        reason = f"q/k/v dtypes differ ({sorted(map(str, dtypes))})"
    elif dtype(out) == torch.float32 and examples[2].dtype in (torch.bfloat16, torch.float16):
        output_dtypes = {0: examples[2].dtype}  # eager promoted the result (an fp32 decay): the op's output cast up
    elif dtype(out) in (torch.bfloat16, torch.float16) and examples[2].dtype == torch.float32:
        # autocast ran the products on fp32 operands in its dtype (the kernels round them to bf16 the same way): the
        # op's fp32 output is cast down to it
        output_dtypes = {0: torch.float32}
    elif dtype(out) != examples[2].dtype:
        reason = f"output dtype {dtype(out)} differs from the inputs' {examples[2].dtype}"
    elif examples[2].dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reason = f"dtype {examples[2].dtype}"
    if reason is None and examples[0].device.type == "cuda" and not cfg.reference:
        if examples[2].dtype == torch.float32 and dtype(out) == torch.float32:
            reason = "fp32 q/k/v (the kernels compute with bf16 products; an fp32 model keeps its precision)"
        else:
            reason = _ops.kernel_supports(shape(q)[-1], shape(v)[-1])
    return Match(
        family=FAMILY,
        outputs=[out, None],
        target=torch.ops.tk.simple_gla.default,
        args=(*(Transpose(t) if lay == "bhnd" else t for t, lay in ((q, lay_q), (k, lay_q), (v, lay_v))),
              Transpose(g), float(scale), None),
        output_transposed=lay_v == "bhnd",
        output_dtypes=output_dtypes,
        reason=reason,
        needs_grad=needs_grad(out),
        has_backward_kernel=_ssd_ops.BACKWARD_KERNEL_VALIDATED,
        device=examples[0].device,
    )
