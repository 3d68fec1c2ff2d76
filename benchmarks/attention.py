"""Attention benchmark: ours (tk_cuda::attention / attention_backward) vs
F.scaled_dot_product_attention with the cuDNN and flash backends, in one run.

Shapes: B*N = 65536 tokens, H*D = 2048 (or the largest multiple of D below), N in 1024..16384, D in {64, 128}
(`--dims`: others; above 128 forward only, as the backward kernels stop there), causal and not; forward and
forward+backward. TFLOPS count 4*B*H*N^2*D for the
forward (halved for causal) and 2.5x that for the backward. Every case's
output is checked against cuDNN before it is timed; the implementations are
timed in three interleaved rounds (median_ms_rounds), so none is always the one
that runs after the others.

    python -m benchmarks.attention [--quick]

`--scores`: the score modifications, sliding windows (Mistral, Gemma-2) and softcapping (Gemma-2), against what a
user would otherwise run: FlexAttention (compiled, with a block mask for the window and a score_mod for the cap) and,
for windows, SDPA with the boolean mask materialised (transformers' sdpa path; torch picks the memory-efficient
kernel). TFLOPS count only the visible (query, key) pairs.

`--varlen`: key-padding masks (right-padded full attention as in BERT, left-padded causal as in batched
generation) and packed sequences (causal, as fine-tuning on packed batches), against SDPA with the dense boolean
mask (memory-efficient and cuDNN backends) and FlexAttention.

`--decode`: one decode step (q length 1) against a KV cache of 1k-32k keys at batch 1-64, against SDPA's backends.

`--dropout P`: the main cases with attention dropout P (training), against SDPA's backends with dropout_p = P (cuDNN,
flash, memory-efficient); ours is checked against the reference with its own mask on the first head (the baselines
draw other random numbers).
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from .common import Row, check_close, median_ms_rounds, progress, rel_error, table

TOKENS = 65536
HIDDEN = 2048
LENGTHS = (1024, 2048, 4096, 8192, 16384)


def cases(quick: bool = False, dims=(128, 64)):
    lengths = (2048, 4096) if quick else LENGTHS
    for D in dims:
        for N in lengths:
            for causal in (False, True):
                yield TOKENS // N, HIDDEN // D, N, D, causal


def _flops(B, H, N, D, causal, backward):
    f = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
    return f * 3.5 if backward else f


def _sdpa(backend, dropout_p: float = 0.0):
    from torch.nn.attention import sdpa_kernel

    def fwd(q, k, v, causal, scale):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)

    return fwd


def _ours_fwd(q, k, v, causal, scale, p=0.0, rng=None):
    return torch.ops.tk_cuda.attention(q, k, v, causal, scale, 0, 0.0, p, rng)[0]


def _ours_fwd_bwd(q, k, v, do, causal, scale, p=0.0, rng=None):
    o, lse = torch.ops.tk_cuda.attention(q, k, v, causal, scale, 0, 0.0, p, rng)
    return torch.ops.tk_cuda.attention_backward(do, q, k, v, o, lse, causal, scale, 0, 0.0, p, rng)


def _check_dropout_head(q, k, v, do, causal, scale, p, rng):
    """Ours with dropout against the reference with the same mask on the first (batch, head), forward and backward
    (the baselines' random numbers are others): the relative errors of o, dq, dk, dv."""
    from tk_inductor.ops.attention import attention_backward_reference, attention_reference

    o, lse = torch.ops.tk_cuda.attention(q, k, v, causal, scale, 0, 0.0, p, rng)
    grads = torch.ops.tk_cuda.attention_backward(do, q, k, v, o, lse, causal, scale, 0, 0.0, p, rng)
    one = [t[:1, :1].float() for t in (q, k, v, do, o)]
    o_ref, _ = attention_reference(*one[:3], causal, scale, 0, 0.0, None, p, rng)
    refs = attention_backward_reference(one[3], *one[:3], one[4], lse[:1, :1], causal, scale, None, 0, 0.0, p, rng)
    return [rel_error(o[:1, :1], o_ref)] + [rel_error(g[:1, :1], r) for g, r in zip(grads, refs)]


def _timed(case: str, fns: dict, flops: float, n: int, notes: dict | None = None) -> list[Row]:
    """Rows of one case: every implementation timed in interleaved rounds; one that fails gets a row saying so and
    the others are timed without it."""
    fns = dict(fns)
    rows = []
    for impl, fn in list(fns.items()):
        try:
            fn()  # a failing implementation drops out before the rounds
        except RuntimeError as exc:
            rows.append(Row("attention", case, impl, None, note=f"failed: {str(exc)[:80]}"))
            del fns[impl]
    for impl, ms in median_ms_rounds(fns).items():
        rows.append(Row("attention", case, impl, ms, flops / ms / 1e9, "TFLOPS", n, (notes or {}).get(impl, "")))
    return rows


def _timed_fwd_bwd(name: str, fns: dict, tensors, flops: float, n: int, backward: bool) -> list[Row]:
    """Rows of one case's forward (fns called as f(q, k, v)) and, with `backward`, forward+backward (3.5x the FLOPs)."""
    q, k, v, do = tensors
    rows = _timed(f"{name} fwd", {i: (lambda f=f: f(q, k, v)) for i, f in fns.items()}, flops, n)
    if backward:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def step(f):
            qg.grad = kg.grad = vg.grad = None
            f(qg, kg, vg).backward(do)

        rows += _timed(f"{name} fwd+bwd", {i: (lambda f=f: step(f)) for i, f in fns.items()}, flops * 3.5, n)
    return rows


def _checked_fwd_bwd(name: str, fns: dict, got, ref, tensors, flops: float, n: int, backward: bool) -> list[Row]:
    """_timed_fwd_bwd after ours' output `got` matched `ref`; a wrong one gets a row saying so and is not timed."""
    rows = []
    try:
        check_close(f"attention {name}", got, ref)
    except AssertionError as exc:
        rows.append(Row("attention", f"{name} fwd", "ours", None, note=f"wrong output: {exc}"))
        fns = {impl: f for impl, f in fns.items() if impl != "ours"}
    return rows + _timed_fwd_bwd(name, fns, tensors, flops, n, backward)


def run(quick: bool = False, backward: bool = True, dims=(128, 64), dropout: float = 0.0) -> list[Row]:
    from torch.nn.attention import SDPBackend

    from tk_inductor import build
    from tk_inductor.ops import philox

    build.load("attention")
    if dropout:
        baselines = {n: _sdpa(b, dropout) for n, b in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
    else:
        baselines = {"cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION), "flash": _sdpa(SDPBackend.FLASH_ATTENTION)}
    rng = philox.draw_seed() if dropout else None
    rows: list[Row] = []
    for B, H, N, D, causal in cases(quick, dims):
        name = f"B{B} H{H} N{N} D{D} {'causal' if causal else 'full'}" + (f" dropout {dropout:g}" if dropout else "")
        progress(name)
        scale = 1.0 / math.sqrt(D)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        impls = [(n, (lambda f=f: f(q, k, v, causal, scale))) for n, f in baselines.items()]
        ours = lambda: _ours_fwd(q, k, v, causal, scale, dropout, rng)  # noqa: E731
        if dropout:
            errs = _check_dropout_head(q, k, v, do, causal, scale, dropout, rng)
            note = "o/dq/dk/dv rel err vs reference, first head " + "/".join(f"{e:.1e}" for e in errs)
            if max(errs) > 2e-2:
                rows.append(Row("attention", f"{name} fwd", "ours", None, note=f"wrong output: {note}"))
            else:
                impls.insert(0, ("ours", ours))
        else:
            ref = baselines["cudnn"](q, k, v, causal, scale)
            try:  # a case is timed only after its output matched
                check_close(f"attention {name}", ours(), ref)
                impls.insert(0, ("ours", ours))
            except AssertionError as exc:
                rows.append(Row("attention", f"{name} fwd", "ours", None, note=f"wrong output: {exc}"))
            del ref
        # forward
        rows += _timed(f"{name} fwd", dict(impls), _flops(B, H, N, D, causal, False), N)
        if not backward:
            del q, k, v, do
            torch.cuda.empty_cache()
            continue
        # forward + backward
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def step(f):
            qg.grad = kg.grad = vg.grad = None
            f(qg, kg, vg, causal, scale).backward(do)

        steps = {impl: (lambda f=f: step(f)) for impl, f in baselines.items()}
        if not dropout:
            ours_grads = _ours_fwd_bwd(q, k, v, do, causal, scale)
            qg.grad = kg.grad = vg.grad = None
            baselines["cudnn"](qg, kg, vg, causal, scale).backward(do)
            errs = [rel_error(a, b.grad) for a, b in zip(ours_grads, (qg, kg, vg))]
            note = "grads rel err vs cudnn " + "/".join(f"{e:.1e}" for e in errs)
            del ours_grads
        if max(errs) > 2e-2:
            rows.append(Row("attention", f"{name} fwd+bwd", "ours", None, note=f"wrong gradients: {note}"))
        else:
            steps = {"ours": lambda: _ours_fwd_bwd(q, k, v, do, causal, scale, dropout, rng), **steps}
        rows += _timed(f"{name} fwd+bwd", steps, _flops(B, H, N, D, causal, True), N, {"ours": note})
        del q, k, v, do, qg, kg, vg
        torch.cuda.empty_cache()
    return rows


def _by_case(rows: list[Row]) -> dict[str, dict[str, Row]]:
    by_case: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.impl] = r
    return by_case


def summary(rows: list[Row]) -> str:
    """Markdown table: TFLOPS per implementation and ours / each baseline (cuDNN, flash, and memory-efficient where
    the run has it: with dropout)."""
    by_case = _by_case(rows)
    names = {"cudnn": "cuDNN", "flash": "flash", "efficient": "efficient"}
    base = [b for b in names if any(b in impls for impls in by_case.values())]
    out = ["| case | ours TFLOPS | " + " | ".join(f"{names[b]} TFLOPS" for b in base) + " | "
           + " | ".join(f"ours/{names[b]}" for b in base) + " |", "|---|---|" + "---|" * (2 * len(base))]

    def fig(r):
        return f"{r.figure:.0f}" if r is not None and r.figure is not None else (r.note if r is not None else "-")

    for case, impls in by_case.items():
        o = impls.get("ours")
        ratios = [f"{impls[b].ms / o.ms:.2f}" if o and impls.get(b) and o.ms and impls[b].ms else "-" for b in base]
        out.append(f"| {case} | {fig(o)} | " + " | ".join(fig(impls.get(b)) for b in base) + " | "
                   + " | ".join(ratios) + " |")
    return "\n".join(out)


SCORE_CASES = (  # (B, Hq, Hkv, N, D, window, softcap): 65536 tokens
    (4, 32, 8, 16384, 128, 4096, 0.0),    # Mistral-7B's window
    (8, 32, 16, 8192, 128, 4096, 50.0),   # Gemma-2-27B's window and cap
    (16, 16, 16, 4096, 128, 0, 50.0),     # cap only (Gemma-2's global layers)
    (16, 16, 16, 4096, 64, 1024, 0.0),
    (8, 16, 8, 8192, 256, 4096, 50.0),    # Gemma-2-9B's window and cap
    (16, 8, 4, 4096, 256, 0, 50.0),       # Gemma-2-2B's global layers
)


def _visible(N, window):
    w = min(window or N, N)
    return N * w - w * (w - 1) / 2  # causal pairs within the window


def run_scores(backward: bool = True) -> list[Row]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from tk_inductor import build
    from tk_inductor.ops import attention as ops  # tk::attention: what the backend's graphs call

    build.load("attention")
    flex = torch.compile(flex_attention)
    rows: list[Row] = []
    for B, Hq, Hkv, N, D, window, cap in SCORE_CASES:
        name = f"B{B} H{Hq}:{Hkv} N{N} D{D} causal" + (f" window {window}" if window else "") + (f" softcap {cap:g}" if cap else "")
        progress(name)
        scale = 1.0 / math.sqrt(D)
        q, do = (torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def visible(b, h, i, j):
            return (j <= i) & (i - j < window) if window else j <= i

        block_mask = create_block_mask(visible, None, None, N, N)

        def score_mod(s, b, h, i, j):
            return cap * torch.tanh(s / cap)

        fns = {
            "ours": lambda q, k, v: ops.attention(q, k, v, True, scale, window, cap)[0],
            "flex": lambda q, k, v: flex(q, k, v, score_mod=score_mod if cap else None, block_mask=block_mask,
                                         scale=scale, enable_gqa=True),
        }
        if window and not cap:
            ii = torch.arange(N, device="cuda")
            dense = (ii[None, :] <= ii[:, None]) & (ii[:, None] - ii[None, :] < window)

            def sdpa_mask(q, k, v):
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=True)

            fns["sdpa+mask"] = sdpa_mask
        flops = 4.0 * B * Hq * _visible(N, window) * D
        rows += _checked_fwd_bwd(name, fns, fns["ours"](q, k, v), fns["flex"](q, k, v), (q, k, v, do), flops, N,
                                 backward)
        del q, k, v, do, block_mask
        torch.cuda.empty_cache()
    return rows


def scores_summary(rows: list[Row]) -> str:
    """Markdown table: ms per implementation and theirs / ours."""
    by_case = _by_case(rows)
    out = ["| case | ours ms | flex ms | sdpa+mask ms | flex/ours | sdpa+mask/ours |", "|---|---|---|---|---|---|"]
    for case, impls in by_case.items():
        o, f, m = impls.get("ours"), impls.get("flex"), impls.get("sdpa+mask")

        def ms(r):
            return f"{r.ms:.3f}" if r is not None and r.ms else (r.note if r is not None else "-")

        def ratio(r):
            return f"{r.ms / o.ms:.2f}" if r is not None and o is not None and r.ms and o.ms else "-"

        out.append(f"| {case} | {ms(o)} | {ms(f)} | {ms(m)} | {ratio(f)} | {ratio(m)} |")
    return "\n".join(out)


# (B, H, N, D, causal, layout): "right"/"left" padding with entry lengths drawn uniformly from [N/4, N], "packed"
# sequences of lengths drawn from [N/32, N/4] filling each entry (seeded).
VARLEN_CASES = [(8, 16, 4096, 128, False, "right"), (8, 16, 4096, 128, True, "left"), (8, 32, 4096, 64, False, "right"),
                (8, 32, 4096, 64, True, "left"), (32, 16, 1024, 128, False, "right"), (2, 16, 16384, 128, True, "packed"),
                (2, 32, 16384, 64, True, "packed")]


def _varlen_masks(B, N, layout, seed):
    """(keep or None, segments or None) of a VARLEN_CASES layout."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(N)
    if layout == "packed":
        segments = torch.zeros(B, N, dtype=torch.long)
        for b in range(B):
            cuts = torch.randint(N // 32, N // 4 + 1, (N // 32,), generator=g).cumsum(0)
            for c in cuts[cuts < N].tolist():
                segments[b, c:] += 1
        return None, segments.cuda()
    lengths = torch.randint(N // 4, N + 1, (B,), generator=g)
    keep = pos[None] < lengths[:, None] if layout == "right" else pos[None] >= (N - lengths)[:, None]
    return keep.cuda(), None


def run_varlen(backward: bool = True) -> list[Row]:
    """Key-padding masks (HF's attention_mask) and packed sequences: ours (tk::attention_varlen, the op the backend's
    graphs call) against SDPA with the boolean (B, 1, N, N) mask materialised (transformers' sdpa path) on the
    memory-efficient and cuDNN backends, and compiled FlexAttention with a block mask (built once, outside the
    timing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from tk_inductor import build
    from tk_inductor.ops import attention as _ops  # noqa: F401  (registers tk::attention_varlen)

    build.load("attention")
    flex = torch.compile(flex_attention)
    rows: list[Row] = []
    for B, H, N, D, causal, layout in VARLEN_CASES:
        keep, segments = _varlen_masks(B, N, layout, seed=B * N + D)
        pos = torch.arange(N, device="cuda")
        name = f"B{B} H{H} N{N} D{D} {'causal' if causal else 'full'} {layout}" + ("" if segments is not None else "-padded")
        progress(name)
        scale = 1.0 / math.sqrt(D)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        ones = torch.ones(B, N, dtype=torch.bool, device="cuda")
        kp = keep if keep is not None else ones
        seg = segments if segments is not None else ones.long()
        dense = kp[:, None, None, :] & (seg[:, None, :, None] == seg[:, None, None, :])
        if causal:
            dense = dense & (pos[None, :] <= pos[:, None])

        def visible(b, h, i, j):
            m = kp[b, j] & (seg[b, i] == seg[b, j])
            return m & (j <= i) if causal else m

        block_mask = create_block_mask(visible, B, None, N, N)

        def sdpa(backend):
            def fn(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
            return fn

        fns = {
            "ours": lambda q, k, v: torch.ops.tk.attention_varlen(q, k, v, keep, segments, causal, scale)[0],
            "sdpa efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
            "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "flex": lambda q, k, v: flex(q, k, v, block_mask=block_mask, scale=scale),
        }
        ref = fns["sdpa efficient"](q, k, v)
        for impl in list(fns):
            try:
                check_close(impl, fns[impl](q, k, v), ref)
            except (AssertionError, RuntimeError) as exc:
                rows.append(Row("attention", f"{name} fwd", impl, None, note=f"failed: {str(exc)[:80]}"))
                del fns[impl]
        visible_pairs = float(dense.expand(B, 1, N, N).sum())
        flops = 4.0 * H * visible_pairs * D
        rows += _timed_fwd_bwd(name, fns, (q, k, v, do), flops, N, backward)
        del q, k, v, do, block_mask, dense
        torch.cuda.empty_cache()
    return rows


def decode_summary(rows: list[Row]) -> str:
    """Markdown table: ms per implementation and ours / the fastest SDPA backend."""
    impls = ("ours", "sdpa flash", "sdpa efficient", "sdpa cudnn", "sdpa default")
    out = ["| case | " + " | ".join(f"{i} ms" for i in impls) + " | best SDPA / ours | default SDPA / ours |",
           "|---" * (len(impls) + 3) + "|"]
    for case, got in _by_case(rows).items():
        cells = [f"{got[i].ms:.4f}" if i in got and got[i].ms else (got[i].note[:30] if i in got else "-") for i in impls]
        best = min((got[i].ms for i in impls[1:4] if i in got and got[i].ms), default=None)
        o = got.get("ours")
        cells.append(f"{best / o.ms:.2f}" if best and o is not None and o.ms else "-")
        d = got.get("sdpa default")
        cells.append(f"{d.ms / o.ms:.2f}" if d is not None and d.ms and o is not None and o.ms else "-")
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def varlen_summary(rows: list[Row]) -> str:
    """Markdown table: ms per implementation and theirs / ours."""
    impls = ("ours", "sdpa efficient", "sdpa cudnn", "flex")
    out = ["| case | " + " | ".join(f"{i} ms" for i in impls) + " | " + " | ".join(f"{i}/ours" for i in impls[1:]) + " |",
           "|---" * (2 * len(impls)) + "|"]
    for case, got in _by_case(rows).items():
        o = got.get("ours")
        cells = [f"{got[i].ms:.3f}" if i in got and got[i].ms else (got[i].note[:40] if i in got else "-")
                 for i in impls]
        ratios = [f"{got[i].ms / o.ms:.2f}" if i in got and got[i].ms and o is not None and o.ms else "-"
                  for i in impls[1:]]
        out.append(f"| {case} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(out)


# Decode: one query per sequence against a KV cache, (B, Hq, Hkv, M, D).
DECODE_CASES = [(B, 32, 8, M, 128) for B in (1, 8, 64) for M in (1024, 8192, 32768)] + [
    (8, 32, 32, 8192, 128), (8, 16, 16, 8192, 64)] + [  # and Gemma-2-9B's heads (D 256)
    (B, 16, 8, M, 256) for B in (1, 8, 32) for M in (1024, 8192, 32768)]


def run_decode() -> list[Row]:
    """One decode step's attention (q length 1, every cached key visible): ours (tk_cuda::attention, which runs the
    split-KV decode kernels for short queries) against SDPA's backends with enable_gqa. GB/s counts the K/V cache
    read once."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tk_inductor import build

    build.load("attention")
    rows: list[Row] = []
    for B, Hq, Hkv, M, D in DECODE_CASES:
        name = f"decode B{B} H{Hq}:{Hkv} M{M} D{D}"
        progress(name)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, M, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def sdpa(backend):
            def fn():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return fn

        kr, vr = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)

        def efficient():  # no enable_gqa on this backend: the cache repeated per query head, as HF's repeat_kv
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(q, kr, vr)

        def default():  # the backend SDPA picks by itself (HF's sdpa path without a mask: enable_gqa)
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        fns = {"ours": lambda: torch.ops.tk_cuda.attention(q, k, v, False, D ** -0.5)[0],
               "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa efficient": efficient,
               "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa default": default}
        ref = efficient()
        for impl in list(fns):
            try:
                check_close(impl, fns[impl](), ref)
            except (AssertionError, RuntimeError) as exc:
                rows.append(Row("attention", name, impl, None, note=f"failed: {str(exc)[:80]}"))
                del fns[impl]
        gbytes = 2 * B * Hkv * M * D * 2 / 1e9
        for impl, ms in median_ms_rounds(fns).items():
            rows.append(Row("attention", name, impl, ms, gbytes / ms * 1e3, "GB/s", M))
        del q, k, v, kr, vr
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N in {2048, 4096} only")
    p.add_argument("--forward-only", action="store_true", help="skip forward+backward timings")
    p.add_argument("--scores", action="store_true", help="sliding windows and softcapping instead")
    p.add_argument("--varlen", action="store_true", help="key-padding masks and packed sequences instead")
    p.add_argument("--decode", action="store_true", help="one decode step against a KV cache instead")
    p.add_argument("--mla", action="store_true", help="q/k head dim 192 with v head dim 128 (DeepSeek's MLA) instead")
    p.add_argument("--sinks-bands", action="store_true",
                   help="attention sinks (gpt-oss) and two-sided windows (ModernBERT) instead")
    p.add_argument("--dims", default="128,64", help="comma-separated head dims (default: 128,64; H = 2048 // D)")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout probability for the main cases")
    args = p.parse_args(argv)
    if args.scores:
        print(scores_summary(run_scores(backward=not args.forward_only)))
    elif args.varlen:
        print(varlen_summary(run_varlen(backward=not args.forward_only)))
    elif args.decode:
        print(decode_summary(run_decode()))
    elif args.mla:
        from .attention_features import run_mla
        print(table(run_mla(backward=not args.forward_only)))
    elif args.sinks_bands:
        from .attention_features import run_sinks_and_bands
        print(scores_summary(run_sinks_and_bands(backward=not args.forward_only)))
    else:
        dims = tuple(int(d) for d in args.dims.split(","))
        print(summary(run(quick=args.quick, backward=not args.forward_only, dims=dims, dropout=args.dropout)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
