"""A/B sweep of the attention forward variants (TK_ATTN_FWD_VARIANT, see
csrc/kernels/attention/README.md) in one process:

1. correctness of every variant against an fp32 reference on random bf16
   inputs: N, M in {1, 17, 1000, 4096}, causal and not, D 64/128, GQA; o and
   lse; plus the backward fed with each variant's lse (one case per D);
2. forward TFLOPS of every variant and of F.scaled_dot_product_attention with
   the cuDNN backend at B*N = 65536, H*D = 2048, N in {2048, 8192}, D 64/128,
   causal and not (the method of benchmarks/attention.py);
3. the backward variants (TK_ATTN_BWD_VARIANT): gradients vs fp32 autograd,
   and backward-only TFLOPS (2.5x the forward's FLOPs) vs cuDNN's backward
   (its forward+backward minus its forward), N = 2048, 8192; one child
   process per backward variant as well.

`--tokens 4096` times B*N = 4096 instead (N = 2048 only): a per-GPU training
shape, where the forward's persistent grid has few tasks per SM. Kernel
switches in the environment (TK_GRID_WAVES, ...) reach every child.

Each variant runs in its own child process with a time limit, so a variant
that hangs or crashes the context costs only its own results. Prints PASS/FAIL
lines, one table, and writes $OUT/sweep_attn.json.

    python3 -m benchmarks.sweep_attn
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from .common import median_ms, no_gpu

VARIANTS = (0, 1, 2, 3, 4, 5, 6, 7)  # --variants sweeps a subset
VARIANT_NAMES = {  # must match FwdVariants in csrc/kernels/attention/forward.cu
    128: {0: "serial BN128 S2", 1: "pp BN128 S2", 2: "pp BN128 S3", 3: "pp BN176 S2", 4: "intra-only BN128 S2",
          5: "pp BN128 S2 poly-exp 1/4", 6: "pp BN128 S2 O by TMA store", 7: "pp BN128 S2 O by TMA, next task's S_0 early"},
    64: {0: "serial BM192 BN128", 1: "pp BM192 BN128", 2: "pp BM128 BN128", 3: "pp BM128 BN192",
         4: "intra-only BM192 BN128", 5: "pp BM192 BN128 poly-exp 1/4", 6: "pp BM192 BN128 O by TMA store",
         7: "pp BM192 BN128 O by TMA, next task's S_0 early"},
}
LENGTHS = (1, 17, 1000, 4096)
OUT_TOL, LSE_ATOL, GRAD_TOL = 1e-2, 2e-3, 2e-2
HIDDEN = 2048


def _set_timed() -> None:
    """B*N of the timed cases, and the (D, N, causal) cases themselves (N <= B*N), from SWEEP_ATTN_TOKENS and
    SWEEP_ATTN_LENGTHS (--tokens, --lengths set them, and the children read them)."""
    global TOKENS, TIMED, BWD_TIMED
    TOKENS = int(os.environ.get("SWEEP_ATTN_TOKENS", 65536))
    lengths = [int(n) for n in os.environ.get("SWEEP_ATTN_LENGTHS", "2048,8192").split(",")]
    TIMED = BWD_TIMED = list(itertools.product((128, 64), [n for n in lengths if n <= TOKENS], (False, True)))


_set_timed()
CHILD_TIMEOUT_S = 40
BWD_VARIANTS = tuple(range(18))  # --bwd-variants sweeps a subset
BWD_VARIANT_NAMES = {  # must match BwdVariants in csrc/kernels/attention/backward.cu
    128: {0: "BM64 S2", 1: "BM64 S2 next-S^T prefetch", 2: "BM64 S2 dS^T x2", 3: "BM64 S3 dS^T x2",
          4: "BM64 S2 lse/delta in smem", 5: "BM64 S2 lse/delta in smem, dQ by key halves",
          6: "BM64 S2 lse/delta in smem, mask branch", 7: "BM64 S2 lse/delta in smem, dQ by key halves, mask branch",
          8: "BM64 S2 lse/delta in smem, mask branch, dK/dV by TMA",
          9: "BM64 S2 lse/delta in smem, mask branch, dK/dV by TMA, dS^T x2, consumers take turns",
          10: "BM64 S2 lse/delta in smem, mask branch, dK/dV by TMA, dS^T by stmatrix",
          11: "BM64 S2 lse/delta in smem, mask branch, dK/dV by TMA, dS^T and dQ staging by stmatrix",
          12: "BM64 S2 lse/delta in smem, mask branch, dK/dV by TMA, dS^T and dQ staging by stmatrix, "
              "lse/delta permuted (16-byte loads)",
          13: "b12 + dS^T x2", 14: "b12 + dS^T x2, consumers take turns", 15: "b12 + dQ reduce by a producer warp",
          16: "b13 + dQ reduce by a producer warp", 17: "b14 + dQ reduce by a producer warp"},
    64: {0: "BM64 S2", 1: "BM64 S2 next-S^T prefetch", 2: "wide BM128 S2", 3: "wide BM128 S2 dQ stage x2",
         4: "wide BM128 S2 lse/delta in smem", 5: "BM64 S2 lse/delta in smem",
         6: "wide BM128 S2 lse/delta in smem, mask branch", 7: "BM64 S2 lse/delta in smem, mask branch",
         8: "wide BM128 S2 lse/delta in smem, mask branch, dK/dV by TMA",
         9: "BM64 S2 lse/delta in smem, mask branch, dK/dV by TMA, consumers take turns",
         10: "wide BM128 S2 lse/delta in smem, mask branch, dK/dV by TMA, dS^T by stmatrix",
         11: "wide BM128 S2 lse/delta in smem, mask branch, dK/dV by TMA, dS^T and dQ staging by stmatrix",
         12: "wide BM128 S2 lse/delta in smem, mask branch, dK/dV by TMA, dS^T and dQ staging by stmatrix, "
             "lse/delta permuted (16-byte loads)",
         13: "BM64 S2 lse/delta in smem, mask branch, dK/dV by TMA, b12's stmatrix and 16-byte stats",
         14: "b13 + consumers take turns", 15: "b13 + dQ reduce by a producer warp",
         16: "b14 + dQ reduce by a producer warp", 17: "b12 + dQ reduce by a producer warp"},
}


def set_variant(v: int | None) -> None:
    if v is None:
        os.environ.pop("TK_ATTN_FWD_VARIANT", None)
    else:
        os.environ["TK_ATTN_FWD_VARIANT"] = str(v)


def reference(q, k, v, causal, scale):
    """fp32 attention, GQA by repeating K/V; (o, lse)."""
    qf, kf, vf = q.float(), k.float(), v.float()
    g = q.shape[1] // k.shape[1]
    kf, vf = kf.repeat_interleave(g, dim=1), vf.repeat_interleave(g, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ vf, torch.logsumexp(s, dim=-1)


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-3 * ref.numel() ** 0.5))


def correctness(ops, variants) -> tuple[list[dict], bool]:
    results, all_ok = [], True
    for i, (D, (N, M), causal) in enumerate(itertools.product((64, 128), itertools.product(LENGTHS, LENGTHS), (False, True))):
        Hq, Hkv = ((4, 4), (4, 2), (8, 1))[i % 3]
        B = 1 if max(N, M) >= 4096 else 2
        g = torch.Generator(device="cuda").manual_seed(i)
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, Hkv, M, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, Hkv, M, D, device="cuda", dtype=torch.bfloat16, generator=g)
        scale = 1.0 / math.sqrt(D)
        o_ref, lse_ref = reference(q, k, v, causal, scale)
        for var in variants:
            set_variant(var)
            torch.full((B, N, Hq, D), float("nan"), device="cuda", dtype=torch.bfloat16)  # poison the allocator
            try:
                o, lse = ops.attention(q, k, v, causal, scale)
                torch.cuda.synchronize()
                err = rel_err(o, o_ref)
                lse_err = float((lse - lse_ref).abs().max())
                nan = bool(torch.isnan(o).any() or torch.isnan(lse).any())
                ok = (not nan) and err < OUT_TOL and lse_err < LSE_ATOL + 1e-4 * float(lse_ref.abs().max())
                note = f"o rel {err:.1e} lse abs {lse_err:.1e}" + (" NaN" if nan else "")
            except RuntimeError as exc:
                ok, note = False, f"error: {str(exc)[:120]}"
            all_ok &= ok
            name = f"v{var} D{D} B{B} H{Hq}:{Hkv} N{N} M{M} {'causal' if causal else 'full'}"
            results.append({"variant": var, "D": D, "N": N, "M": M, "causal": causal, "ok": ok, "note": note})
            if not ok:
                print(f"FAIL {name}: {note}", flush=True)
    # The backward consumes the forward's lse: run it on each variant's output.
    for D in (64, 128):
        B, Hq, Hkv, N = 2, 4, 2, 1000
        g = torch.Generator(device="cuda").manual_seed(100 + D)
        q, k, v, do = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (Hq, Hkv, Hkv, Hq))
        for causal in (False, True):
            qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
            o_ref, _ = reference(qr, kr, vr, causal, 1.0 / math.sqrt(D))
            o_ref.backward(do.float())
            for var in variants:
                set_variant(var)
                o, lse = ops.attention(q, k, v, causal, 1.0 / math.sqrt(D))
                grads = ops.attention_backward(do, q, k, v, o, lse, causal, 1.0 / math.sqrt(D))
                errs = [rel_err(a, b.grad) for a, b in zip(grads, (qr, kr, vr))]
                ok = max(errs) < GRAD_TOL and not any(bool(torch.isnan(g_).any()) for g_ in grads)
                all_ok &= ok
                note = "grads rel " + "/".join(f"{e:.1e}" for e in errs)
                results.append({"variant": var, "D": D, "N": N, "M": N, "causal": causal, "ok": ok, "note": "bwd " + note})
                if not ok:
                    print(f"FAIL bwd v{var} D{D} {'causal' if causal else 'full'}: {note}", flush=True)
    set_variant(None)
    return results, all_ok


def _inputs(D, N):
    B, H = TOKENS // N, HIDDEN // D
    g = torch.Generator(device="cuda").manual_seed(N + D)
    return B, H, [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def _flops(B, H, N, D, causal):
    return 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)


def _cudnn(q, k, v, causal, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def bench(fn) -> float:
    """Median ms (do_bench, L2 cleared between calls); a short budget keeps the sweep inside its time limit."""
    fn()
    return median_ms(fn, warmup_ms=10, rep_ms=100)


def timing_cudnn() -> list[dict]:
    """F.scaled_dot_product_attention (cuDNN backend) per timed case."""
    rows = []
    for D, N, causal in TIMED:
        B, H, (q, k, v) = _inputs(D, N)
        scale = 1.0 / math.sqrt(D)
        row = {"D": D, "N": N, "B": B, "H": H, "causal": causal}

        try:
            row["cudnn_ms"] = bench(lambda: _cudnn(q, k, v, causal, scale))
            row["cudnn_tflops"] = _flops(B, H, N, D, causal) / row["cudnn_ms"] / 1e9
        except RuntimeError as exc:
            row["cudnn_ms"], row["cudnn_note"] = None, str(exc)[:100]
        rows.append(row)
    return rows


def timing_variant(ops, var) -> list[dict]:
    """Forward time of one variant per timed case; timed only if its output matches cuDNN's on the same inputs."""
    rows = []
    for D, N, causal in TIMED:
        B, H, (q, k, v) = _inputs(D, N)
        scale = 1.0 / math.sqrt(D)
        row = {"D": D, "N": N, "causal": causal}
        try:
            ref = _cudnn(q, k, v, causal, scale)
            set_variant(var)
            o = ops.attention(q, k, v, causal, scale)[0]
            err = rel_err(o, ref)
            del ref
            if err > OUT_TOL or bool(torch.isnan(o).any()):
                row["ms"], row["note"] = None, f"wrong output (rel {err:.1e} vs cuDNN)"
            else:
                row["ms"] = bench(lambda: ops.attention(q, k, v, causal, scale))
                row["tflops"] = _flops(B, H, N, D, causal) / row["ms"] / 1e9
        except RuntimeError as exc:
            row["ms"], row["note"] = None, str(exc)[:100]
        rows.append(row)
    set_variant(None)
    return rows


def table(rows: list[dict]) -> str:
    head = ["case", "cuDNN TF"] + [f"v{v} TF" for v in VARIANTS] + [f"v{v}/cuDNN" for v in VARIANTS]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        case = f"B{r['B']} H{r['H']} N{r['N']} D{r['D']} {'causal' if r['causal'] else 'full'}"
        c = r.get("cudnn_ms")

        def tf(key):
            x = r.get(key)
            return f"{x:.0f}" if x else "-"

        cells = [case, tf("cudnn_tflops")] + [tf(f"v{v}_tflops") for v in VARIANTS]
        cells += [f"{c / r[f'v{v}_ms']:.2f}" if c and r.get(f"v{v}_ms") else "-" for v in VARIANTS]
        out.append("| " + " | ".join(cells) + " |")
    out.append("variants: " + "; ".join(f"D{D}: " + ", ".join(f"v{v} {n}" for v, n in names.items()) for D, names in VARIANT_NAMES.items()))
    return "\n".join(out)


def geomeans(rows: list[dict]) -> dict[str, float]:
    """Geometric mean of ours/cuDNN per (D, variant) over the timed cases."""
    out = {}
    for D in (128, 64):
        for var in VARIANTS:
            r_ = [r["cudnn_ms"] / r[f"v{var}_ms"] for r in rows if r["D"] == D and r.get("cudnn_ms") and r.get(f"v{var}_ms")]
            if r_:
                out[f"D{D} v{var}"] = math.exp(sum(map(math.log, r_)) / len(r_))
    return out


def timing_cudnn_bwd() -> list[dict]:
    """cuDNN's backward alone per backward timed case: (forward + backward) - forward."""
    rows = []
    for D, N, causal in BWD_TIMED:
        B, H, (q, k, v) = _inputs(D, N)
        do = torch.randn_like(q)
        scale = 1.0 / math.sqrt(D)
        row = {"D": D, "N": N, "B": B, "H": H, "causal": causal}
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def cudnn_step():
            qg.grad = kg.grad = vg.grad = None
            _cudnn(qg, kg, vg, causal, scale).backward(do)

        try:
            ms = bench(cudnn_step) - bench(lambda: _cudnn(q, k, v, causal, scale))
            row["cudnn_ms"], row["cudnn_tflops"] = ms, _flops(B, H, N, D, causal) * 2.5 / ms / 1e9
        except RuntimeError as exc:
            row["cudnn_ms"], row["cudnn_note"] = None, str(exc)[:100]
        rows.append(row)
    return rows


def backward_child(bv: int, out_path: str) -> int:
    """One backward variant: gradients vs fp32 autograd, then backward time. The forward is the serial
    variant 0 here, so that these results do not depend on the forward variants under test."""
    from tk_inductor import build

    os.environ["TK_ATTN_FWD_VARIANT"] = "0"
    os.environ["TK_ATTN_BWD_VARIANT"] = str(bv)
    build.load("attention")
    ops = torch.ops.tk_cuda
    results, ok = [], True
    # N = 128 / 129 / 2048 straddle the 128-row q tile of the wide D = 64 variants.
    cases = [(D, N, M) for D in (64, 128) for N, M in ((17, 17), (1000, 1000), (17, 1000), (1000, 17), (129, 300), (2048, 2048))]
    for i, ((D, N, M), causal) in enumerate(itertools.product(cases, (False, True))):
        B, Hq, Hkv = 2, *((4, 4), (4, 2), (6, 1))[i % 3]
        g = torch.Generator(device="cuda").manual_seed(200 + i)
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, Hkv, M, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        do = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        scale = 1.0 / math.sqrt(D)
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
        o_ref, _ = reference(qr, kr, vr, causal, scale)
        o_ref.backward(do.float())
        o, lse = ops.attention(q, k, v, causal, scale)
        try:
            grads = ops.attention_backward(do, q, k, v, o, lse, causal, scale)
            torch.cuda.synchronize()
            errs = [rel_err(a, b_.grad) for a, b_ in zip(grads, (qr, kr, vr))]
            good = max(errs) < GRAD_TOL and not any(bool(torch.isnan(t).any()) for t in grads)
            note = "grads rel " + "/".join(f"{e:.1e}" for e in errs)
        except RuntimeError as exc:
            good, note = False, f"error: {str(exc)[:120]}"
        ok &= good
        results.append({"bwd_variant": bv, "D": D, "N": N, "M": M, "causal": causal, "ok": good, "note": note})
    rows = []
    for D, N, causal in BWD_TIMED:
        row = {"D": D, "N": N, "causal": causal}
        if not ok:  # a variant with wrong gradients is not timed, so it cannot be picked as the best
            row["ms"], row["note"] = None, "not timed: wrong gradients"
            rows.append(row)
            continue
        B, H, (q, k, v) = _inputs(D, N)
        do = torch.randn_like(q)
        scale = 1.0 / math.sqrt(D)
        o, lse = ops.attention(q, k, v, causal, scale)
        try:
            row["ms"] = bench(lambda: ops.attention_backward(do, q, k, v, o, lse, causal, scale))
            row["tflops"] = _flops(B, H, N, D, causal) * 2.5 / row["ms"] / 1e9
        except RuntimeError as exc:
            row["ms"], row["note"] = None, str(exc)[:100]
        rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"results": results, "ok": ok, "timing": rows}, f)
    return 0


def child(var: int, out_path: str) -> int:
    from tk_inductor import build

    os.environ["TK_ATTN_BWD_VARIANT"] = "0"  # the backward check here tests the forward's lse only

    build.load("attention")
    ops = torch.ops.tk_cuda
    t0 = time.time()
    results, ok = correctness(ops, (var,))
    t1 = time.time()
    rows = timing_variant(ops, var)
    with open(out_path, "w") as f:
        json.dump({"results": results, "ok": ok, "timing": rows, "correct_s": t1 - t0, "timing_s": time.time() - t1}, f)
    return 0


def best(rows: list[dict], variants=VARIANTS, prefix: str = "v") -> dict[str, str]:
    """Per (D, causal): the variant with the highest geomean cuDNN/ours time ratio over N, from the rows'
    `{prefix}{variant}_ms` timings (what FwdVariants<D>::DEFAULT / DEFAULT_CAUSAL, or with prefix "b" and the
    backward variants BwdVariants<D>::DEFAULT, should be)."""
    out = {}
    for D, causal in itertools.product((128, 64), (False, True)):
        sel = [r for r in rows if r["D"] == D and r["causal"] == causal and r.get("cudnn_ms")]
        scores = {}
        for var in variants:
            r_ = [r["cudnn_ms"] / r[f"{prefix}{var}_ms"] for r in sel if r.get(f"{prefix}{var}_ms")]
            if sel and len(r_) == len(sel):
                scores[var] = math.exp(sum(map(math.log, r_)) / len(r_))
        if scores:
            v = max(scores, key=scores.get)
            out[f"D{D} {'causal' if causal else 'full'}"] = f"{prefix}{v} ({scores[v]:.3f}x cuDNN)"
    return out


def run_child(extra: list[str], timeout: float) -> tuple[dict | None, str]:
    """Runs this module as a child process; (its JSON, "") or (None, why not)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    cmd = [sys.executable, "-m", "benchmarks.sweep_attn", *extra, "--child-out", path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        data = json.load(open(path)) if proc.returncode == 0 else None
        status = "" if data else f"child exit {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}"
    except subprocess.TimeoutExpired:
        data, status = None, f"child timed out after {timeout:.0f} s (hang?)"
    except (OSError, ValueError) as exc:
        data, status = None, f"child output unreadable: {exc}"
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return data, status.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sweep_attn", description=__doc__.splitlines()[0])
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-bwd", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-backward", action="store_true", help="skip the backward variants")
    ap.add_argument("--no-forward", action="store_true", help="skip the forward variants")
    ap.add_argument("--tokens", type=int, default=None, help="B*N of the timed cases (default 65536; >= 2048)")
    ap.add_argument("--lengths", default=None, help="sequence lengths N of the timed cases (default 2048,8192)")
    ap.add_argument("--variants", default=None, help="forward variants to check and time, e.g. 1,6 (default: all)")
    ap.add_argument("--bwd-variants", default=None, help="backward variants to check and time (default: all)")
    args = ap.parse_args(argv)
    global VARIANTS, BWD_VARIANTS

    def subset(flag: str, known: tuple[int, ...], value: str | None) -> tuple[int, ...]:
        if not value:
            return known
        picked = tuple(int(v) for v in value.split(","))
        if not set(picked) <= set(known):
            ap.error(f"{flag}: the known variants are {known}")
        return picked

    VARIANTS = subset("--variants", VARIANTS, args.variants)
    BWD_VARIANTS = subset("--bwd-variants", BWD_VARIANTS, args.bwd_variants)
    if args.tokens is not None:
        if args.tokens < 2048:
            ap.error("--tokens must be >= 2048")
        os.environ["SWEEP_ATTN_TOKENS"] = str(args.tokens)  # for the children
    if args.lengths is not None:
        if not all(n.isdigit() and int(n) >= 1 for n in args.lengths.split(",")):
            ap.error("--lengths: comma-separated positive integers")
        os.environ["SWEEP_ATTN_LENGTHS"] = args.lengths
    _set_timed()
    if (why := no_gpu()) is not None:
        print(f"python -m benchmarks.sweep_attn: {why}")
        return 2
    if args.child is not None:
        return child(args.child, args.child_out)
    if args.child_bwd is not None:
        return backward_child(args.child_bwd, args.child_out)

    from tk_inductor import build

    t0 = time.time()
    build.load("attention")  # children load the cached build
    t_build = time.time() - t0
    print(f"build/load: {t_build:.1f} s", flush=True)
    rows = [] if args.no_forward else timing_cudnn()
    torch.cuda.empty_cache()
    results, all_ok, per_variant = [], True, {}
    for var in () if args.no_forward else VARIANTS:
        t1 = time.time()
        data, status = run_child(["--child", str(var)], CHILD_TIMEOUT_S)
        if data is None:
            all_ok = False
            per_variant[var] = "FAIL (" + status + ")"
            print(f"  v{var}: FAIL {status}", flush=True)
            continue
        results += data["results"]
        bad = [r for r in data["results"] if not r["ok"]]
        for r in bad:
            print(f"FAIL v{var} D{r['D']} N{r['N']} M{r['M']} {'causal' if r['causal'] else 'full'}: {r['note']}")
        all_ok &= not bad
        per_variant[var] = "PASS" if not bad else f"FAIL ({len(bad)}/{len(data['results'])} cases)"
        for row, t in zip(rows, data["timing"]):
            assert (row["D"], row["N"], row["causal"]) == (t["D"], t["N"], t["causal"])
            row[f"v{var}_ms"], row[f"v{var}_tflops"] = t.get("ms"), t.get("tflops")
            if t.get("note"):
                row[f"v{var}_note"] = t["note"]
        print(f"  v{var}: {per_variant[var]} ({len(data['results'])} checks, {time.time() - t1:.0f} s)", flush=True)
    gm, bests = {}, {}
    if not args.no_forward:
        print(f"forward correctness: {'PASS' if all_ok else 'FAIL'}")
        print(table(rows))
        gm = geomeans(rows)
        print("geomean ours/cuDNN: " + ", ".join(f"{k} {v:.3f}" for k, v in gm.items()))
        bests = best(rows, VARIANTS)
        print("best variant: " + ", ".join(f"{k}: {v}" for k, v in bests.items()))
    bwd = None
    if not args.no_backward:
        bwd = {"results": [], "ok": True, "timing": timing_cudnn_bwd(), "per_variant": {}}
        torch.cuda.empty_cache()
        for bv in BWD_VARIANTS:
            t1 = time.time()
            data, status = run_child(["--child-bwd", str(bv)], CHILD_TIMEOUT_S)
            if data is None:
                bwd["ok"] = False
                bwd["per_variant"][bv] = "FAIL (" + status + ")"
                print(f"  b{bv}: FAIL {status}", flush=True)
                continue
            bwd["results"] += data["results"]
            bad = [r for r in data["results"] if not r["ok"]]
            for r in bad:
                print(f"FAIL bwd b{bv} D{r['D']} N{r['N']} M{r['M']} {'causal' if r['causal'] else 'full'}: {r['note']}")
            bwd["ok"] &= data["ok"] and not bad
            bwd["per_variant"][bv] = "PASS" if not bad else f"FAIL ({len(bad)}/{len(data['results'])} cases)"
            for row, t in zip(bwd["timing"], data["timing"]):
                assert (row["D"], row["N"], row["causal"]) == (t["D"], t["N"], t["causal"])
                row[f"b{bv}_ms"], row[f"b{bv}_tflops"] = t.get("ms"), t.get("tflops")
                if t.get("note"):
                    row[f"b{bv}_note"] = t["note"]
            print(f"  b{bv}: {bwd['per_variant'][bv]} ({len(data['results'])} checks, {time.time() - t1:.0f} s)", flush=True)
        all_ok &= bwd["ok"]
        print(f"backward variants: {'PASS' if bwd['ok'] else 'FAIL'} ({len(bwd['results'])} checks)")
        print("| bwd-only case | cuDNN TF | " + " | ".join(f"b{v} TF" for v in BWD_VARIANTS) + " | "
              + " | ".join(f"b{v}/cuDNN" for v in BWD_VARIANTS) + " |")
        print("|---" * (2 + 2 * len(BWD_VARIANTS)) + "|")
        for r in bwd["timing"]:
            c = r.get("cudnn_ms")
            cells = [f"B{r['B']} H{r['H']} N{r['N']} D{r['D']} {'causal' if r['causal'] else 'full'}",
                     f"{r['cudnn_tflops']:.0f}" if r.get("cudnn_tflops") else "-"]
            cells += [f"{r[f'b{v}_tflops']:.0f}" if r.get(f"b{v}_tflops") else "-" for v in BWD_VARIANTS]
            cells += [f"{c / r[f'b{v}_ms']:.2f}" if c and r.get(f"b{v}_ms") else "-" for v in BWD_VARIANTS]
            print("| " + " | ".join(cells) + " |")
        print("bwd variants: " + "; ".join(f"D{D}: " + ", ".join(f"b{v} {n}" for v, n in names.items())
                                           for D, names in BWD_VARIANT_NAMES.items()))
        bwd["best"] = best(bwd["timing"], BWD_VARIANTS, "b")
        print("best bwd variant: " + ", ".join(f"{k}: {v}" for k, v in bwd["best"].items()))
    print(f"correctness overall: {'PASS' if all_ok else 'FAIL'}")
    print(f"total {time.time() - t0:.0f} s (build/load {t_build:.0f} s)")
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sweep_attn.json"), "w") as f:
        json.dump({"correct": all_ok, "per_variant": per_variant, "correctness": results, "timing": rows,
                   "geomean": gm, "best": bests, "backward": bwd, "variants": VARIANT_NAMES,
                   "bwd_variants": BWD_VARIANT_NAMES, "build_s": t_build}, f, indent=1)
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
