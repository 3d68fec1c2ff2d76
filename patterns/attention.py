"""Matcher for softmax attention on the Dynamo (torch-IR) graph -> `tk::attention`.

Two sources, one op:
* `F.scaled_dot_product_attention`: no mask, `is_causal=True`, or an `attn_mask` the mask analysis proves causal,
  a causal sliding window or all-visible; a constant `dropout_p` (SDPA drops even in eval); the default or a given
  scale; GQA by `enable_gqa` or a `repeat_kv` in front of it.
* eager `matmul -> scale -> [softcap] -> mask -> softmax -> dropout -> matmul`:
  - the products as `torch.matmul`, `@`, `torch.bmm` on (B*H, N, D) views (also 3-D scores viewed to 4-D),
    `torch.baddbmm(_, q, kᵀ, beta=0, alpha=scale)` (GPT-2) or the two einsums; kᵀ by `transpose`, `permute`, `.mT`;
  - scaling by `mul`/`div` with positive constants on q, k or the scores, before or after the mask;
  - softcapping `cap · tanh(a · s)` as Gemma-2 writes it (`/ cap`, `tanh`, `* cap`, before any mask): the op's
    softcap = cap with scale = a · cap;
  - masks by `masked_fill`, `torch.where` or an additive `s + mask`, with -inf or a finite value <= finfo(fp16).min
    (zero probability after the max-subtracting softmax, unless genuine scores are below about -6.5e4; `-1e4` is
    kept); several masks intersect;
  - softmax over the last dim in any spelling, in fp32 (`dtype=` or an upcast and a cast back) or the inputs' dtype;
    `dropout` with constant p and training flag (GPT-2's `attn_dropout`);
  - `repeat_kv` / `repeat_interleave(x, r, dim=1)` are dropped (the op does GQA), and HF's empty-cache
    `torch.cat([tensor([]), k], dim=-2)` is seen through.

Masks are *proven*, not guessed: `_MaskEval` (patterns/_mask.py) interprets the subgraph that builds a mask as affine
functions of the element index (aranges, views, advanced indexing, diff/cumsum of constant steps), intersections of
half-planes in (query i, key j), two-valued selections and run-time literals (patterns/_varlen.py): tril/triu,
arange comparisons, `where`, `masked_fill` (`~allowed` read through its negation), and transformers 5.x's
`sdpa_mask`/`eager_mask`. On the scores' box, {j <= i} is causal (top-left, as the op), {i - w < j <= i} a sliding
window of w (transformers' `sliding_window_overlay`), everything all-visible. HF's padding `attention_mask` and its
packed-sequence ids (from position ids that restart) are run-time data: such masks go to `tk::attention_varlen`,
which reads their values at run time (with a finite fill, rows without keys average v, as eager computes). A tensor
written in place is not the op that made it: such a mask is kept, except one case read before the prover
(patterns/_blocks.py): a full fill with diagonal blocks that tile the sequence written visible (Pixtral's images packed in
one sequence), which runs as packed sequences with static ids (SDPA's mask).

A mask that *is* a graph input (as after DDP's graph splitting, FSDP2's graph breaks or a per-layer compile) goes to
`tk::attention_masked`: the op checks its values once per mask tensor and runs the kernel for a causal,
sliding-window or all-visible mask, SDPA with the mask otherwise. The graph that made the mask proves it here too
(`output_mask_kinds`), and the backend records the proof on the output tensor, so the op need not read the values.
So does, in inference, SDPA's mask with causal bounds at a symbolic offset (new queries against a cache).

Kept, each with its reason in the report: arbitrary masks, two-sided windows, diagonal-offset causal masks, additive
biases (ALiBi, relative position), any other op between the products, attention weights used elsewhere
(output_attentions), value head dim != q/k head dim, Hq % Hkv != 0, batch broadcasting, dropout together with a
softcap or a mask handed into the graph, and (kernel mode on CUDA) dtypes other than bf16/fp16, head dims the kernels
lack, or dropout above head dim 128: limits of the kernels, checked only when a kernel would run (CUDA inputs,
reference mode off in the compile's resolved config, `find(graph, cfg)`).
Dropout p > 0 becomes the op's Philox dropout (the dropout_p of tk::attention, or of tk::attention_varlen under padding
or packed sequences, with a tk::philox_seed node drawing its (seed, offset) pair each run): the same distribution as
torch's, not the same random numbers.
"""
from __future__ import annotations

import logging
import math
from typing import Iterator

import torch
import torch.fx as fx

from tk_inductor import config
from tk_inductor.ops import attention as attention_ops
from tk_inductor.ops import attention_varlen as varlen_ops
from tk_inductor.ops import attention_masked as masked_ops
from tk_inductor.rewrite import Match, example

from ._fx import arg as _arg
from ._affine import Aff, Neg, Pred, _and, _as_pred, _not
from ._fx import _CASTS, in_place, Keep, eq, known, mutated_after, needs_grad, number, rank, shape
from ._fx import name as _name
from ._blocks import static_blocks
from ._mask import _additive_allowed, _fill_finite, _fill_ok, _mask_kind, _MaskEval, MaskKind, RunTimeRuns
from ._varlen import _from_graph_input
from ._products import (_MATMULS, _dropout_p, _is_product, _operands, _path_to, _same_scores, _softmax_dim_ok,
                        _softmax_dtype)
from ._qkv import _Operand, _peel, _positive_const
from . import _sinks

FAMILY = "attention"
log = logging.getLogger("tk_inductor")


class _Finder:
    def __init__(self, graph: fx.Graph, cfg: config.Config | None = None):
        self.graph = graph
        self.masks = _MaskEval()
        self.reference = (cfg or config.current()).reference

    # ------------------------------------------------------------------ shared checks and the match
    def _match(self, out: fx.Node, qo: _Operand, ko: _Operand, vo: _Operand, kind: MaskKind, scale: float,
               keep: str | None = None, mixed: bool = False, mask: fx.Node | None = None,
               softcap: float = 0.0, sdpa_split_kv: bool = False, dropout_p: float = 0.0, sink=None) -> Match:
        exs = [example(o.node) for o in (qo, ko, vo)]
        device = exs[0].device if isinstance(exs[0], torch.Tensor) else None
        m = Match(FAMILY, [out], needs_grad=needs_grad(qo.node, ko.node, vo.node), device=device, reason=keep)
        if keep is None:
            try:
                m.target, m.args, m.outputs = self._call(out, qo, ko, vo, kind, scale, mixed, mask, softcap,
                                                         sdpa_split_kv, dropout_p, sink)
            except Keep as e:
                m.reason = str(e)
        return m

    def _call(self, out, qo, ko, vo, kind: MaskKind, scale, mixed=False, mask=None, softcap=0.0, sdpa_split_kv=False,
              dropout_p=0.0, sink=None):
        exs = [example(o.node) for o in (qo, ko, vo)]
        if not all(isinstance(e, torch.Tensor) for e in exs):
            raise Keep("q/k/v example values are missing")
        dts = [o.dtype() for o in (qo, ko, vo)]
        if len(set(dts)) != 1 or not dts[0].is_floating_point:
            raise Keep(f"q/k/v dtypes {[str(d) for d in dts]} (the op needs one float dtype)")
        dtype = dts[0]
        if isinstance(example(out), torch.Tensor) and example(out).dtype != dtype:
            raise Keep(f"the output dtype {example(out).dtype} differs from the inputs' {dtype}")
        if len({e.device for e in exs}) != 1:
            raise Keep("q/k/v are on different devices")
        merged = {o.merged for o in (qo, ko, vo)}
        if len(merged) != 1 and not mixed:
            raise Keep("only some of q/k/v are (B*H, N, D) views of 4-D tensors")
        ranks = {e.dim() for e in exs}
        if ranks != {4} and ranks != {3}:
            raise Keep(f"q/k/v of ranks {sorted(e.dim() for e in exs)} (the op takes 4-D, or 3-D batched)")
        transposed = tuple(o.needs_transpose() for o in (qo, ko, vo))
        shapes = []
        for tr, e in zip(transposed, exs):
            s = list(e.shape)
            if tr:
                s[-2], s[-1] = s[-1], s[-2]
            shapes.append(s)
        (qs, ks, vs) = shapes
        if not eq(ks[-1], qs[-1]):
            raise Keep(f"q and k head dims differ ({qs[-1]} vs {ks[-1]})")
        # a value head dim other than q/k's (MLA: DeepSeek's 192 / 128) runs zero-padded to the larger one
        own_value_dim = not eq(vs[-1], qs[-1])
        if own_value_dim and (number(vs[-1]) is None or number(qs[-1]) is None):
            raise Keep(f"value head dim {vs[-1]} differs from the query/key head dim {qs[-1]}, not as constants")
        # k and v lengths the graph cannot prove equal (two KV-cache inputs, each with its own size symbol) are equal
        # wherever the graph runs: the original attention raises otherwise, and so does the op.
        if known(ks[-2] != vs[-2]):
            raise Keep("k and v lengths differ")
        if not (eq(qs[0], ks[0]) and eq(ks[0], vs[0])):
            raise Keep("the batch is broadcast between q and k/v")
        if len(qs) == 4:
            hq, hk, hv = qs[1], ks[1], vs[1]
            if not eq(hk, hv):
                raise Keep(f"k and v head counts differ ({hk} vs {hv})")
            if not known(hq % hk == 0):
                raise Keep(f"query heads ({hq}) are not a multiple of key/value heads ({hk})")
        elif ko.repeated != 1 or vo.repeated != 1 or not eq(qs[0], ks[0]):
            raise Keep("3-D attention with repeated key/value heads")
        if not (scale > 0 and math.isfinite(scale)):
            raise Keep(f"scale {scale} is not a positive finite number")
        if exs[0].device.type == "cuda" and not self.reference:
            why = attention_ops.kernel_supports(dtype, max(number(qs[-1]), number(vs[-1])) if own_value_dim
                                                else number(qs[-1]), needs_grad(qo.node, ko.node, vo.node),
                                                dropout_p > 0)
            if why is not None:
                raise Keep(why)
            rows = number(qs[-2])
            if sdpa_split_kv and not dropout_p and rows is not None and rows <= attention_ops.DECODE_ROWS:
                raise Keep(f"a decode step ({rows} query rows) on SDPA's grouped-query path without a mask, whose "
                           "split-KV kernels run it as fast as the decode kernels or faster")
        if mixed and not (rank(out) == 4 and all(eq(a, b) for a, b in zip(shape(out)[:2], qs[:2]))):
            raise Keep("the 3-D scores are viewed to heads that differ from q's")
        heads = "4d" if len(qs) == 4 and (mixed or not qo.merged) else ("merged" if qo.merged else "none")
        args = (qo.arg(), ko.arg(), vo.arg(), bool(kind.causal), float(scale), int(kind.window), float(softcap))
        if heads == "merged":
            back = self._merged_back(out, qs[:-1] + [vs[-1]])
            if back is not None:
                heads, out = "4d", back
        # The op's o is a transposed view of a (B, N, H, D) buffer; a later `.view` of the eager
        # (contiguous) result may not be expressible on it, so those users get a contiguous copy.
        contiguous = any(_name(u) in ("view", "view_as") for u in out.users)
        # padding, packed sequences and a two-sided window run on interval tables (tk::attention_varlen)
        varlen = (kind.pad is not None or kind.segments is not None or bool(kind.window and not kind.causal)
                  or bool(kind.chunk) or bool(kind.blocks))
        if kind.window and not kind.causal and not known(qs[-2] <= ks[-2] + kind.window - 1):
            raise Keep("a two-sided window with rows that may see no key (more queries than keys + window - 1)")
        if dropout_p and softcap:
            raise Keep("dropout on softcapped scores (the kernels' dropout takes no softcap)")
        if dropout_p and mask is not None:
            raise Keep("dropout with a mask handed into the graph (tk::attention_masked takes no dropout)")
        if (mask is not None or varlen) and own_value_dim:
            raise Keep(f"value head dim {vs[-1]} differs from the query/key head dim {qs[-1]} under a mask known only "
                       "at run time (its ops take one head dim)")
        if (mask is not None or varlen) and (heads != "4d" or any(transposed) or contiguous):
            raise Keep("the mask's values are known only at run time and the layout needs an adapter")
        # dropout's (seed, offset) pair is drawn in the adapters (tk::philox_seed)
        if sink is not None and heads != "4d":
            raise Keep("attention sinks on 3-D heads")
        if varlen:  # padding / packed sequences: their values are read at run time (tk::attention_varlen)
            pad = kind.pad or (None, 0)
            # With sinks a row that sees no key puts all its mass on the sink (o = 0) whatever the fill: so the
            # kernels' empty rows, not the finite fill's uniform average.
            uniform_empty = kind.uniform_empty and sink is None
            return (varlen_ops.attention_varlen_adapter,
                    args + pad + (kind.segments, uniform_empty, dropout_p, kind.chunk, kind.chunk_from_pad, sink,
                                  kind.blocks),
                    [out])
        if sink is not None and mask is None:
            return attention_ops.attention_sink_adapter, args + (sink, transposed, contiguous, dropout_p), [out]
        if dropout_p:
            return attention_ops.attention_adapter, args + (transposed, heads, contiguous, dropout_p), [out]
        if mask is not None:  # values known only at run time: the op checks them (tk::attention_masked)
            if getattr(example(mask), "requires_grad", False):
                raise Keep("the mask/bias requires grad (a learned bias)")
            args = (qo.arg(), ko.arg(), vo.arg(), mask, float(scale), float(softcap))
            if sink is not None:
                return masked_ops.attention_masked_sink_adapter, args + (sink,), [out]
            return torch.ops.tk.attention_masked.default, args, [out, None]
        if heads == "4d" and not any(transposed) and not contiguous:
            return torch.ops.tk.attention.default, args, [out, None]
        return attention_ops.attention_adapter, args + (transposed, heads, contiguous), [out]

    @staticmethod
    def _merged_back(out: fx.Node, q4) -> fx.Node | None:
        """The single user that views the (B*H, N, D) output back to (B, H, N, D), if any."""
        if len(out.users) != 1:
            return None
        (user,) = out.users
        if _name(user) not in ("view", "reshape") or user.args[0] is not out:
            return None
        s = shape(user) or ()
        if len(s) == 4 and all(eq(a, b) for a, b in zip(s, q4)):
            return user
        return None

    # ------------------------------------------------------------------ SDPA
    def sdpa(self, node: fx.Node) -> Match:
        q, k, v = (_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        qo = _peel(q, allow_merge=False, allow_scale=True)
        ko = _peel(k, allow_merge=False, allow_scale=True)
        vo = _peel(v, allow_merge=False, allow_scale=False)
        mask = _arg(node, 3, "attn_mask")
        dropout_p = number(_arg(node, 4, "dropout_p", 0.0))
        is_causal = number(_arg(node, 5, "is_causal", False))
        scale = _arg(node, 6, "scale")
        try:
            if qo.transposed or ko.transposed or vo.transposed:
                qo, ko, vo = _Operand(q), _Operand(k), _Operand(v)
            for n in (qo.node, ko.node, vo.node):
                if mutated_after(n, node):
                    raise Keep(f"`{n.name}` is modified in place after the attention reads it")
            if dropout_p is None or not 0 <= dropout_p < 1:
                raise Keep(f"SDPA dropout_p={_arg(node, 4, 'dropout_p')} is not a constant in [0, 1)")
            if is_causal is None:
                raise Keep("SDPA is_causal is not a constant")
            kind = MaskKind(bool(is_causal))
            runtime_mask = None
            if mask is not None:
                try:
                    kind = self._sdpa_mask(mask, (shape(node) or ())[:-1] + ((shape(k) or ())[-2],))
                except Keep as e:
                    # A graph input, or in inference runs with symbolic bounds: read at run time (not in training:
                    # where the values are not runs, the op's SDPA backward is slower than the original's)
                    runs = isinstance(e, RunTimeRuns) and not needs_grad(q, k, v)
                    if is_causal or not (_from_graph_input(mask) or runs):
                        raise
                    runtime_mask = mask
            d = number(shape(q)[-1]) if shape(q) else None
            if scale is None:
                if d is None:
                    raise Keep("default scale of a symbolic head dim")
                scale = 1.0 / math.sqrt(d)
            scale = number(scale)
            if scale is None:
                raise Keep("SDPA scale is not a constant")
            scale = float(scale) * qo.scale * ko.scale
            if rank(q) not in (3, 4):
                raise Keep(f"SDPA inputs of rank {rank(q)} (the op takes 4-D)")
            sq, sv = shape(q) or (), shape(v) or ()
            ex = example(q)
            if sq and sv and not eq(sq[-1], sv[-1]) and isinstance(ex, torch.Tensor) and ex.device.type == "cuda" \
                    and not self.reference:
                # H200: cuDNN ran 192 / 128 at 1.1-1.5x our padded kernels forward, 1.5-2x forward+backward
                raise Keep("a value head dim other than q/k's under SDPA, whose cuDNN backend runs it natively "
                           "(faster than the kernels on zero-padded heads)")
        except Keep as e:
            return self._match(node, qo, ko, vo, MaskKind(False), 1.0, keep=str(e))
        # SDPA's own split-KV path: no mask and the K/V heads as they are (enable_gqa), where cuDNN/flash run a decode
        # step at least as fast as the decode kernels
        own_split_kv = mask is None and ko.repeated == 1 and vo.repeated == 1
        return self._match(node, qo, ko, vo, kind, scale, mask=runtime_mask, sdpa_split_kv=own_split_kv,
                           dropout_p=float(dropout_p))

    def _sdpa_mask(self, mask: fx.Node, score_shape: tuple) -> MaskKind:
        blocks = static_blocks(mask, number(score_shape[-1])) if eq(score_shape[-1], score_shape[-2]) else None
        if blocks:  # image blocks packed in one sequence: static packed-sequence ids (tk::attention_varlen)
            return MaskKind(False, blocks=blocks)
        try:
            v = self.masks(mask)
        except Keep as e:
            raise type(e)(f"attn_mask is not provably causal: {e}") from None
        if example(mask).dtype == torch.bool:
            return _mask_kind(_as_pred(v), score_shape)
        return _mask_kind(_additive_allowed(v), score_shape, _fill_finite(v))

    # ------------------------------------------------------------------ eager
    def eager(self, qk: fx.Node) -> Match | None:
        is_softmax = lambda u, prev: _name(u) == "softmax"  # noqa: E731
        softmax_path, sink, dropped = _path_to(qk, is_softmax, depth=10), None, []
        if softmax_path is None:  # attention sinks: the scores and one more logit per row, its column dropped after
            to_cat = _path_to(qk, _sinks.is_sink_cat, depth=8)
            rest = to_cat and _path_to(to_cat[-1], is_softmax, depth=4)
            if not rest:
                return None
            softmax_path, sink = to_cat + rest[1:], _sinks.sink_operand(to_cat[-1])
        sm = softmax_path[-1]
        if sink is not None:
            dropped = [u for u in sm.users if _sinks.drops_sink(u, sm)]
            if len(dropped) != 1:
                return None

        def is_pv(u, prev):
            return _is_product(u, "pv") and _operands(u)[0] is prev

        pv_path = _path_to(dropped[0] if dropped else sm, is_pv, depth=6)
        if pv_path is None:
            return None
        pv = pv_path[-1]
        chain = softmax_path[1:-1]
        after = pv_path[1:-1]
        q, kt = _operands(qk)
        _, v = _operands(pv)
        want_t = _name(qk) != "einsum"
        # (B*H, N, D) views are peeled back to (B, H, N, D) on the side(s) that multiply in 3-D
        qk_3d, pv_3d = rank(qk) == 3, rank(pv) == 3
        qo = _peel(q, qk_3d, allow_scale=True)
        ko = _peel(kt, qk_3d, allow_scale=True)
        vo = _peel(v, pv_3d, allow_scale=False)
        # scores made in 3-D and viewed to 4-D before a 4-D value product: fine when the 4-D output's
        # (B, H) are q's, which pins the scores' view to the same (B, H) split (checked in _call)
        mixed = qo.merged and ko.merged and not vo.merged and not pv_3d
        if len({qo.merged, ko.merged, vo.merged}) != 1 and not mixed:
            qo, ko, vo = _peel(q, False, True), _peel(kt, False, True), _peel(v, False, False)
            mixed = False
        ko.want_t = want_t
        try:
            # the row max a stable softmax subtracts reads its scores too
            shifts = [m for a, b in zip([qk] + chain, chain) for m in (_sinks.is_row_max_shift(b, a) or ())]
            for n in [qk] + chain + [sm] + dropped + after:
                if any(in_place(u) for u in n.users):
                    raise Keep(f"`{n.name}` is modified in place")
            for n in (qo.node, ko.node, vo.node):
                if mutated_after(n, qk):
                    raise Keep(f"`{n.name}` is modified in place after the attention reads it")
            if any(u not in shifts and u not in chain for n in shifts for u in n.users):
                raise Keep("the scores' row max is also used elsewhere")
            for n in [qk] + chain + [sm] + dropped + after:
                if len([u for u in n.users if u not in shifts]) != 1:
                    raise Keep(f"the attention weights (`{n.name}`) are also used elsewhere "
                                "(e.g. output_attentions)")
            if not _softmax_dim_ok(sm):
                raise Keep("softmax is not over the key dimension")
            sdt = _softmax_dtype(sm)
            if sdt is not None and sdt not in (torch.float32, torch.float64, example(q).dtype):
                raise Keep(f"softmax in {sdt}")
            q_dtype = qo.dtype()
            scale, kind, softcap, runtime_mask = self._scores_chain(qk, chain, q_dtype)
            if _name(qk) == "baddbmm":
                alpha = _positive_const(qk.kwargs.get("alpha", 1))
                if alpha is None:
                    raise Keep("baddbmm alpha is not a positive constant")
                scale *= alpha
            drops = [p for p in (self._probs_step(n, q_dtype) for n in after) if p]
            if len(drops) > 1:
                raise Keep("two dropouts of the attention weights")
            scale *= qo.scale * ko.scale
        except Keep as e:
            return self._match(pv, qo, ko, vo, MaskKind(False), 1.0, keep=str(e))
        return self._match(pv, qo, ko, vo, kind, scale, mixed=mixed, mask=runtime_mask, softcap=softcap,
                           dropout_p=drops[0] if drops else 0.0, sink=sink)

    def _cast_ok(self, n: fx.Node, q_dtype) -> None:
        dt = example(n).dtype
        if dt not in (torch.float32, torch.float64, q_dtype):
            raise Keep(f"the scores are cast to {dt}, below the inputs' {q_dtype}")

    def _scores_chain(self, qk: fx.Node, chain: list[fx.Node], q_dtype
                      ) -> tuple[float, MaskKind, float, fx.Node | None]:
        """(scale, the masks' kind, softcap or 0, mask whose values are known only at run time, or None). A softcap
        is `tanh` between scaling and a multiplication by the cap, before any mask (tanh(-inf) is -1, no mask)."""
        scale, runtime_mask = 1.0, None
        allowed = None  # the intersection of the proven masks' allowed sets; its kind is decided at the end
        fills = set()  # whether each proven mask's fill is finite
        softcap, capping = 0.0, None  # capping: None, "tanh" (its multiply is next), "done"
        masks, added = 0, None  # masks proven so far; the last one added to the scores (fx node) while none follow
        sunk = False  # past the attention sinks' cat
        runs = None  # a RunTimeRuns raised while proving an added mask (its values are read at run time)
        scores = shape(qk) or ()
        prev = qk
        add_mask = lambda p: p if allowed is None else _and(allowed, p)  # noqa: E731

        for n in chain:
            name = _name(n)
            others = [a for a in list(n.args) + list(n.kwargs.values()) if a is not prev]
            if name in ("contiguous", "clone", "view", "reshape"):
                pass  # the path search already checked that views keep (rows, N, M)
            elif name in _CASTS:
                self._cast_ok(n, q_dtype)
            elif name in ("mul", "div") and len(n.args) == 2 and not n.kwargs:
                c = _positive_const(others[0]) if len(others) == 1 else None
                if runtime_mask is not None:
                    raise Keep("the scores are scaled after a run-time mask was added (SDPA adds it after scaling)")
                added = None
                if c is None or (name == "div" and n.args[0] is not prev):
                    runtime = len(others) == 1 and isinstance(others[0], fx.Node) \
                        and not isinstance(example(others[0]), torch.Tensor)
                    raise Keep("the scores are scaled by a run-time value (dynamic=True passes float attributes "
                                "as tensors)" if runtime else
                                f"the scores are scaled by a non-constant or non-positive `{n.name}`")
                if capping == "tanh" and name == "mul":
                    softcap, capping, scale = c, "done", scale * c
                elif capping is not None:
                    raise Keep("the softcapped scores are scaled again (or tanh's are divided)")
                else:
                    scale *= c if name == "mul" else 1.0 / c
            elif name in ("add",) and len(n.args) == 2 and not n.kwargs:
                try:
                    allowed = add_mask(self._additive(others[0], fills))  # each mask must be provable
                    masks += 1
                    added = others[0] if len(others) == 1 else None
                except RunTimeRuns as e:
                    runs, masks, added = e, masks + 1, others[0] if len(others) == 1 else None
                except Keep:
                    m = others[0] if len(others) == 1 else None
                    if runtime_mask is not None or allowed is not None or not _from_graph_input(m) \
                            or not isinstance(example(m), torch.Tensor) or not example(m).is_floating_point():
                        raise
                    runtime_mask = m
            elif name == "masked_fill" and n.args[0] is prev:
                fill = number(_arg(n, 2, "value"))
                if fill is None:
                    try:
                        fv = self.masks(_arg(n, 2, "value"))
                        fill = fv.c if isinstance(fv, Aff) and not fv.coefs else None
                    except Keep:
                        fill = None
                if not _fill_ok(fill):
                    raise Keep(f"masked_fill value {_arg(n, 2, 'value')} does not vanish in softmax")
                allowed = add_mask(self._hidden_complement(_arg(n, 1, "mask")))  # each mask must be provable
                fills.add(math.isfinite(fill))
                masks += 1
            elif name == "where" and len(n.args) == 3:
                cond, a, b = n.args
                if a is prev:
                    fill, keeps = b, True
                elif b is prev:
                    fill, keeps = a, False
                else:
                    raise Keep("where() on the scores in an unknown form")
                fv = self._const_value(fill)
                if not _fill_ok(fv):
                    raise Keep(f"where() fill value {fill} does not vanish in softmax")
                p = self._bool_mask(cond)
                allowed = add_mask(p if keeps else _not(p))  # each mask must be provable
                fills.add(math.isfinite(fv))
                masks += 1
            elif name == "cat" and _sinks.is_sink_cat(n, prev):
                if capping == "tanh":
                    raise Keep("tanh of the scores without a multiplication by the cap (softcapping)")
                sunk = True  # the scores are one column wider from here: only the row-max shift may follow
                prev = n
                continue
            elif name == "sub" and _sinks.is_row_max_shift(n, prev):
                pass  # softmax(s - rowmax(s)) = softmax(s)
            elif name == "tanh":
                if capping is not None:
                    raise Keep("tanh is applied to the scores twice")
                if masks or runtime_mask is not None:
                    raise Keep("the scores are masked before the softcap's tanh")
                capping = "tanh"
            elif name in ("add", "sub"):
                raise Keep(f"a tensor is combined with the scores by `{n.name}` (bias)")
            else:
                raise Keep(f"`{n.name}` ({name or n.target}) between the score product and the softmax")
            if sunk and name not in ("sub", "contiguous", "clone", *_CASTS):
                raise Keep(f"`{n.name}` ({name}) after the attention sinks' logits are concatenated")
            if not sunk and not _same_scores(shape(n) or (), scores):
                raise Keep(f"`{n.name}` broadcasts the scores to a larger shape")
            prev = n
        if capping == "tanh":
            raise Keep("tanh of the scores without a multiplication by the cap (softcapping)")
        if allowed is not None and allowed.pads and len(fills) > 1:
            raise Keep("a padding mask among masks with finite and infinite fills (rows without keys would average "
                       "only some keys)")
        try:
            if runs is not None:
                raise runs
            kind = _mask_kind(allowed, scores, fills == {True}) if allowed is not None else MaskKind(False)
        except RunTimeRuns:
            # In inference, one additive mask whose rows are runs only at run time (bounds at a symbolic offset, as
            # HF builds a decode step's mask) is read by tk::attention_masked, as SDPA's (not in training: where the
            # values are not runs, the op's backward is slower than the original's).
            ex = example(added) if isinstance(added, fx.Node) else None
            if masks != 1 or needs_grad(qk) or not isinstance(ex, torch.Tensor) or not ex.is_floating_point():
                raise
            kind, runtime_mask = MaskKind(False), added
        if runtime_mask is not None and kind.causal:
            raise Keep("a proven causal mask and a run-time mask are both applied")
        return scale, kind, softcap, runtime_mask

    def _const_value(self, x):
        v = number(x)
        if v is not None:
            return v
        try:
            fv = self.masks(x)
        except Keep:
            return None
        return fv.c if isinstance(fv, Aff) and not fv.coefs else None

    def _hidden_complement(self, hidden) -> Pred:
        """The allowed set of masked_fill's hidden set; `~allowed` is read as `allowed`, and a band's hidden set
        (|i - j| > w, a union, which the analysis of intersections of half-planes holds as its complement) as the
        band."""
        if isinstance(hidden, fx.Node) and _name(hidden) == "not" and len(hidden.args) == 1:
            return self._bool_mask(hidden.args[0])
        try:
            v = self.masks(hidden)
            return v.pred if isinstance(v, Neg) else _not(_as_pred(v))
        except Keep as e:
            raise Keep(f"mask is not provably causal: {e}") from None

    def _bool_mask(self, x) -> Pred:
        try:
            return _as_pred(self.masks(x))
        except Keep as e:
            raise Keep(f"mask is not provably causal: {e}") from None

    def _additive(self, x, fills: set):
        try:
            v = self.masks(x)
        except Keep as e:
            raise type(e)(f"additive mask/bias is not provably causal: {e}") from None
        allowed = _additive_allowed(v)
        fills.add(_fill_finite(v))
        return allowed

    def _probs_step(self, n: fx.Node, q_dtype) -> float:
        """Checks a step between the softmax and the value product; a dropout's probability, else 0."""
        name = _name(n)
        if name in ("contiguous", "clone", "view", "reshape"):
            return 0.0
        if name in _CASTS:
            self._cast_ok(n, q_dtype)
            return 0.0
        if name == "dropout":
            return _dropout_p(n)
        raise Keep(f"`{n.name}` ({name or n.target}) between the softmax and the value product")


def find(graph: fx.Graph, cfg: config.Config | None = None) -> Iterator[Match]:
    finder = _Finder(graph, cfg)
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        name = _name(node)
        try:
            if name == "sdpa":
                yield finder.sdpa(node)
            elif name in _MATMULS + ("baddbmm", "einsum") and _is_product(node, "qk"):
                m = finder.eager(node)
                if m is not None:
                    yield m
            elif name == "baddbmm" and _path_to(node, lambda u, _: _name(u) == "softmax", 4) is not None:
                # scores = bias + alpha·q kᵀ: BLOOM's ALiBi position biases (beta 1), which the kernels do not add
                yield Match(FAMILY, [node], reason="the scores are a `baddbmm` adding its input to q kᵀ (an additive "
                                                   "bias, such as BLOOM's ALiBi position biases)")
        except Exception as exc:  # noqa: BLE001 - an odd graph must not stop the other families' rewrites
            log.debug("tk_inductor: attention matcher failed on %s", node.format_node(), exc_info=True)
            yield Match(FAMILY, [node], reason=f"matcher could not analyse `{node.name}` ({type(exc).__name__}: {exc})")


def output_mask_kinds(graph: fx.Graph) -> dict[int, str]:
    """The graph's outputs that are masks proven causal or all-visible over their own last two dims, by output
    position: {i: "causal" | "full"}. A graph that makes the mask hands it to the layers' graphs as an input when
    DDP splits the graph or a graph break falls between them; the backend records these proofs on the output
    tensors at run time (ops.attention_masked.prove_mask), so the consumers' `tk::attention_masked` need not read the
    values of each step's new mask (a wait for the GPU)."""
    out = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    if out is None:
        return {}
    values = out.args[0]
    flat = list(values) if isinstance(values, (tuple, list)) else [values]
    finder = _Finder(graph)  # the matcher's own mask proof, over the mask's own box
    kinds: dict[int, str] = {}
    for i, node in enumerate(flat):
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            continue
        ex = example(node)
        if not isinstance(ex, torch.Tensor) or ex.dim() < 2 or not (ex.dtype == torch.bool or ex.is_floating_point()):
            continue
        try:
            kind = finder._sdpa_mask(node, shape(node) or ())
            if kind.window or kind.pad is not None or kind.segments is not None or kind.chunk:
                continue  # tk::attention_masked runs causal or all-visible masks only
            kinds[i] = "causal" if kind.causal else "full"
        except Keep:
            continue
        except Exception:  # noqa: BLE001  (an analysis bug must cost a value check, never the compile)
            log.debug("tk_inductor: output mask analysis failed on %s", node.name, exc_info=True)
    return kinds
