"""Rotary kernel variants side by side, in one device run (issue 5).

For every variant of tk_cuda::rotary_variant: correctness against tk_inductor.ops.rotary.reference on odd
sizes (N 1/17/1000, H 1/3/16 with GQA k, D 64/128 and narrow-vector shapes, partial rotary, both layouts,
NeoX and interleaved, forward and backward, fp16/bf16/fp32, outputs poisoned with NaN first), then bf16
bandwidth at the benchmark cases against torch.compile default on HF's apply_rotary_pos_emb and the
device-to-device copy ceiling. GB/s count minimal bytes: q, k read and written once, cos/sin read once.

    python3 -m benchmarks.sweep_rot [--quick]

Prints one table and the variant to make default; writes $OUT/sweep_rot.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from .common import check_close, copy_ceiling_gbs, median_ms, no_gpu, progress
from .rotary import apply_rotary_pos_emb

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
BUDGET_S = 95  # stop adding torch.compile baselines past this (the run must stay under 120 s)
DEVICE = "cuda"


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _poison(*tensors: torch.Tensor) -> None:
    """NaN-filled free blocks of the outputs' sizes, so elements a kernel leaves unwritten read as NaN."""
    blocks = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEVICE) for t in tensors]
    del blocks


def correctness_cases(quick: bool):
    """(name, q, k, cos, sin, interleaved, backward, contiguous): q/k (B, H, N, D) views, cos/sin 4-D."""
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def mk(*s, dtype):
        return torch.randn(*s, generator=g, device=DEVICE).to(dtype)

    dims = [(128, 128), (64, 64), (128, 32), (64, 16), (128, 96), (80, 40), (18, 10)]
    sizes = [(1, 1), (17, 3), (1000, 16)]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    i = 0
    for dtype in dtypes:
        for layout in ("BHND", "BNHD"):
            for interleaved in (False, True):
                for D, rd in dims if not quick else dims[:3]:
                    for N, H in sizes:
                        B, Hk = 2, max(1, H // 2)
                        if layout == "BNHD":
                            q, k = mk(B, N, H, D, dtype=dtype).transpose(1, 2), mk(B, N, Hk, D, dtype=dtype).transpose(1, 2)
                        else:
                            q, k = mk(B, H, N, D, dtype=dtype), mk(B, Hk, N, D, dtype=dtype)
                        # general tables (halves and pairs differ): the partner's sin must be the right one
                        cos, sin = mk(B, 1, N, rd, dtype=dtype), mk(B, 1, N, rd, dtype=dtype)
                        name = f"{str(dtype)[6:]} {layout} {'gptj' if interleaved else 'neox'} D{D} rd{rd} N{N} H{H}/{Hk}"
                        yield name, q, k, cos, sin, interleaved, bool(i % 2), bool(i % 3 == 0)
                        i += 1
    # broadcasts and shapes that take other paths: tables shared over the batch, per-head tables (first kernel),
    # q and k with different lengths (one launch each), q alone, 3-D input
    bf = torch.bfloat16
    q, k = mk(3, 5, 33, 128, dtype=bf), mk(3, 5, 33, 128, dtype=bf)
    yield "batch-shared tables", q, k, mk(1, 1, 33, 64, dtype=bf), mk(1, 1, 33, 64, dtype=bf), False, False, False
    yield "per-head tables", q, k, mk(3, 5, 33, 128, dtype=bf), mk(3, 5, 33, 128, dtype=bf), False, True, False
    yield ("q/k lengths differ", q, mk(3, 2, 7, 128, dtype=bf), mk(1, 1, 1, 128, dtype=bf), mk(1, 1, 1, 128, dtype=bf),
           True, False, False)
    yield "q alone", q, None, mk(3, 1, 33, 128, dtype=bf), mk(3, 1, 33, 128, dtype=bf), False, False, True
    yield "3-D", mk(4, 19, 64, dtype=bf), mk(4, 19, 64, dtype=bf), mk(4, 19, 32, dtype=bf), mk(4, 19, 32, dtype=bf), True, True, False


def check_variant(variant: int, cases) -> list[str]:
    """Failures of one variant (empty: all passed); cases as correctness_cases gives them, plus the reference outputs."""
    from tk_inductor.ops import rotary as rot_ops

    failures = []
    for name, q, k, cos, sin, interleaved, backward, contiguous, want in cases:
        qk, kk, ck, sk = rot_ops._kernel_operands(q, k, cos, sin)
        _poison(*([want[0]] + ([want[1]] if k is not None else [])))
        try:
            got = torch.ops.tk_cuda.rotary_variant(qk, kk, ck, sk, interleaved, backward, contiguous, variant)
            torch.cuda.synchronize()
        except RuntimeError as exc:
            failures.append(f"{name}: {str(exc)[:100]}")
            continue
        rd = cos.shape[-1]
        for which, x, a, e in (("q", q, got[0], want[0]), ("k", k, got[1], want[1])):
            if x is None:
                continue
            if torch.isnan(a).any():
                failures.append(f"{name} {which}: NaN (unwritten)")
            elif a.stride() != e.stride():
                failures.append(f"{name} {which}: strides {a.stride()} != {e.stride()}")
            elif (err := _rel_err(a, e)) > TOL[x.dtype]:
                failures.append(f"{name} {which}: rel err {err:.1e}")
            elif not torch.equal(a[..., rd:], x[..., rd:]):
                failures.append(f"{name} {which}: pass-through channels changed")
    return failures


def timing_cases(quick: bool):
    """(name, B, H, N, D, rotary_dim, layout); BNHD is what HF's q_proj(x).view(B, N, H, D).transpose(1, 2) gives."""
    yield "D128", 16, 16, 4096, 128, 128, "BHND"
    yield "D64", 16, 16, 4096, 64, 64, "BHND"
    yield "D128 rd32", 16, 16, 4096, 128, 32, "BHND"
    if not quick:
        yield "D128 BNHD", 16, 16, 4096, 128, 128, "BNHD"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.sweep_rot", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer correctness shapes, no BNHD timing")
    args = p.parse_args(argv)
    if (why := no_gpu()) is not None:
        print(f"python -m benchmarks.sweep_rot: {why}")
        return 2
    start = time.time()
    from tk_inductor import build

    build.load("rotary")
    build_s = time.time() - start
    names = list(torch.ops.tk_cuda.rotary_variants())
    default = int(torch.ops.tk_cuda.rotary_default_variant())
    progress(f"built/loaded rotary in {build_s:.1f} s; {len(names)} variants, default {default} ({names[default]})")

    from tk_inductor.ops import rotary as rot_ops

    cases = [c + (rot_ops.reference(*c[1:]),) for c in correctness_cases(args.quick)]
    failures = {}
    for v, name in enumerate(names):
        failures[name] = check_variant(v, cases)
        progress(f"correctness {name}: {'PASS' if not failures[name] else 'FAIL'} ({len(cases)} cases)")
    del cases
    torch.cuda.empty_cache()

    ceiling = copy_ceiling_gbs()
    rows = []
    for case, B, H, N, D, rd, layout in timing_cases(args.quick):
        progress(case)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        shape = (B, N, H, D) if layout == "BNHD" else (B, H, N, D)
        q = torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.bfloat16)
        if layout == "BNHD":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        ang = torch.rand(B, N, rd // 2, generator=g, device=DEVICE) * 6.3
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)
        nbytes = (4 * B * H * N * D + 2 * B * N * rd) * 2
        ref = apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())

        def record(impl, fn, direction="fwd", want=ref):
            try:
                qo, ko = fn()
                check_close(f"{impl} {case} q", qo, want[0])
                check_close(f"{impl} {case} k", ko, want[1])
                ms = median_ms(fn, warmup_ms=10, rep_ms=100)
                rows.append({"case": f"{case} {direction}", "impl": impl, "ms": ms, "gbs": nbytes / ms / 1e6})
            except (RuntimeError, AssertionError) as exc:
                rows.append({"case": f"{case} {direction}", "impl": impl, "ms": None, "note": str(exc)[:120]})

        for v, name in enumerate(names):
            record(name, lambda v=v: torch.ops.tk_cuda.rotary_variant(q, k, c4, s4, False, False, False, v))
        if time.time() - start < BUDGET_S:
            record("torch.compile", lambda f=torch.compile(apply_rotary_pos_emb, dynamic=False): f(q, k, cos, sin))
        else:
            rows.append({"case": f"{case} fwd", "impl": "torch.compile", "ms": None, "note": "skipped: time budget"})
        if case == "D128":  # the backward is the same kernel with the tables swapped: one case shows it costs the same
            want = rot_ops.reference(q.float(), k.float(), c4.float(), s4.float(), False, True, False)
            for v, name in enumerate(names):
                record(name, lambda v=v: torch.ops.tk_cuda.rotary_variant(q, k, c4, s4, False, True, False, v), "bwd", want)
        q = k = ref = None  # free before the next case's inputs
        torch.cuda.empty_cache()

    # table: one line per (case, impl), with % of copy and ours/compile
    compile_ms = {r["case"].rsplit(" ", 1)[0]: r["ms"] for r in rows if r["impl"] == "torch.compile"}
    lines = [f"copy ceiling {ceiling:.0f} GB/s; build+load {build_s:.1f} s; default variant {default} ({names[default]})",
             "| case | impl | ms | GB/s | % copy | x compile | correct |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = compile_ms.get(r["case"].rsplit(" ", 1)[0])
        r["pct_copy"] = 100 * r["gbs"] / ceiling if r.get("ms") else None
        r["x_compile"] = base / r["ms"] if r.get("ms") and base else None
        ok = "-" if r["impl"] == "torch.compile" else ("PASS" if not failures[r["impl"]] else "FAIL")
        cells = [r["case"], r["impl"], f"{r['ms']:.4f}" if r["ms"] else r.get("note", "-"),
                 f"{r['gbs']:.0f}" if r.get("ms") else "-", f"{r['pct_copy']:.1f}%" if r["pct_copy"] else "-",
                 f"{r['x_compile']:.3f}" if r["x_compile"] else "-", ok]
        lines.append("| " + " | ".join(cells) + " |")
    # the variant to make default: correct everywhere, then the best worst case over the forward cases
    worst = {}
    for name in names:
        fwd = [r for r in rows if r["impl"] == name and r["case"].endswith("fwd")]
        if failures[name] or not fwd or any(not r.get("ms") for r in fwd):
            continue
        ratios = [r["x_compile"] for r in fwd if r["x_compile"]]
        worst[name] = (min(ratios) if ratios else 0.0, min(r["pct_copy"] for r in fwd))
    for name in names:
        if name in worst:
            lines.append(f"variant {names.index(name)} {name}: worst x compile {worst[name][0]:.3f}, worst % copy {worst[name][1]:.1f}%")
        else:
            lines.append(f"variant {names.index(name)} {name}: FAIL " + "; ".join(failures[name][:5]))
    best = max(worst, key=lambda n: worst[n]) if worst else None
    lines.append(f"best variant: {names.index(best)} ({best})" if best else "best variant: none passed")
    lines.append(f"total {time.time() - start:.1f} s")
    print("\n".join(lines))

    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sweep_rot.json"), "w") as f:
        json.dump({"variants": names, "default": default, "best": best, "copy_gbs": ceiling, "build_s": build_s,
                   "failures": failures, "rows": rows, "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__}, f, indent=1)
    return 0 if all(not f for f in failures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
