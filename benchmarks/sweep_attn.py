"""A/B sweep of the attention forward variants (TK_ATTN_FWD_VARIANT, see
csrc/kernels/attention/README.md) in one process:

1. correctness of every variant against an fp32 reference on random bf16
   inputs: N, M in {1, 17, 1000, 4096}, causal and not, D 64/128, GQA; o and
   lse; plus the backward fed with each variant's lse (one case per D);
2. forward TFLOPS of every variant and of F.scaled_dot_product_attention with
   the cuDNN backend at B*N = 65536, H*D = 2048, N in {2048, 8192}, D 64/128,
   causal and not (the method of benchmarks/attention.py).

Prints PASS/FAIL lines, one table, and writes $OUT/sweep_attn.json.

    python3 -m benchmarks.sweep_attn
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from .common import median_ms

VARIANTS = (0, 1, 2, 3, 4)
VARIANT_NAMES = {  # must match FwdVariants in csrc/kernels/attention/forward.cu
    128: {0: "serial BN128 S2", 1: "pp BN128 S2", 2: "pp BN128 S3", 3: "pp BN176 S2", 4: "intra-only BN128 S2"},
    64: {0: "serial BM192 BN128", 1: "pp BM192 BN128", 2: "pp BM128 BN128", 3: "pp BM128 BN192", 4: "intra-only BM192 BN128"},
}
LENGTHS = (1, 17, 1000, 4096)
OUT_TOL, LSE_ATOL, GRAD_TOL = 1e-2, 2e-3, 2e-2
TOKENS, HIDDEN = 65536, 2048


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


def correctness(ops) -> tuple[list[dict], bool]:
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
        for var in VARIANTS:
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
            for var in VARIANTS:
                set_variant(var)
                o, lse = ops.attention(q, k, v, causal, 1.0 / math.sqrt(D))
                grads = ops.attention_backward(do, q, k, v, o, lse, causal, 1.0 / math.sqrt(D))
                errs = [rel_err(a, b.grad) for a, b in zip(grads, (qr, kr, vr))]
                ok = max(errs) < GRAD_TOL
                all_ok &= ok
                note = "grads rel " + "/".join(f"{e:.1e}" for e in errs)
                results.append({"variant": var, "D": D, "N": N, "M": N, "causal": causal, "ok": ok, "note": "bwd " + note})
                if not ok:
                    print(f"FAIL bwd v{var} D{D} {'causal' if causal else 'full'}: {note}", flush=True)
    set_variant(None)
    return results, all_ok


def timing(ops) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for D, N, causal in itertools.product((128, 64), (2048, 8192), (False, True)):
        B, H = TOKENS // N, HIDDEN // D
        scale = 1.0 / math.sqrt(D)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
        row = {"D": D, "N": N, "B": B, "H": H, "causal": causal}

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        try:
            ref = cudnn()
            row["cudnn_ms"] = median_ms(cudnn)
        except RuntimeError as exc:
            ref, row["cudnn_ms"] = None, None
            row["cudnn_note"] = str(exc)[:100]
        for var in VARIANTS:
            set_variant(var)
            try:
                o = ops.attention(q, k, v, causal, scale)[0]
                if ref is not None and rel_err(o, ref) > OUT_TOL:
                    row[f"v{var}_ms"] = None
                    row[f"v{var}_note"] = f"wrong output (rel {rel_err(o, ref):.1e})"
                    continue
                row[f"v{var}_ms"] = median_ms(lambda: ops.attention(q, k, v, causal, scale))
            except RuntimeError as exc:
                row[f"v{var}_ms"] = None
                row[f"v{var}_note"] = str(exc)[:100]
        set_variant(None)
        for key in [k_ for k_ in row if k_.endswith("_ms")]:
            if row[key]:
                row[key.replace("_ms", "_tflops")] = flops / row[key] / 1e9
        rows.append(row)
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


def main() -> int:
    from tk_inductor import build

    t0 = time.time()
    build.load("attention")
    ops = torch.ops.tk_cuda
    t_build = time.time() - t0
    print(f"build/load: {t_build:.1f} s", flush=True)
    results, ok = correctness(ops)
    n_fail = sum(not r["ok"] for r in results)
    print(f"correctness: {'PASS' if ok else 'FAIL'} ({len(results) - n_fail}/{len(results)} cases)", flush=True)
    for var in VARIANTS:
        bad = [r for r in results if r["variant"] == var and not r["ok"]]
        print(f"  v{var}: {'PASS' if not bad else f'FAIL ({len(bad)} cases)'}", flush=True)
    t1 = time.time()
    rows = timing(ops)
    print(table(rows))
    gm = geomeans(rows)
    print("geomean ours/cuDNN: " + ", ".join(f"{k} {v:.3f}" for k, v in gm.items()))
    print(f"times: build {t_build:.0f} s, correctness {t1 - t0 - t_build:.0f} s, timing {time.time() - t1:.0f} s")
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sweep_attn.json"), "w") as f:
        json.dump({"correct": ok, "correctness": results, "timing": rows, "geomean": gm,
                   "variants": VARIANT_NAMES, "build_s": t_build}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
