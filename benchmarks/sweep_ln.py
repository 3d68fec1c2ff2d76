"""Layernorm variant sweep: every forward / backward kernel variant checked against the op's reference,
then timed against torch.compile default on the same eager code, in one device run (< 120 s with the build).

Variants are picked per call by TK_LN_FWD_VARIANT / TK_LN_BWD_VARIANT (csrc/kernels/layernorm/layernorm.h):
    forward  0 legacy | 1, 2, 3 persistent, 2 / 3 / 4 stages of cp.async staging | 4, 5 legacy, one row per
             block, 1 / 2 vectors/thread | 6 persistent, 2 stages, row in shared memory only, <= 64 registers
             | 7 legacy split, one row per block | 8 5 with w, b loaded early and h stored last (hidden <= 2048)
    backward 0 legacy | 1 persistent, 3 stages, 1 vector/thread, 1024 threads/SM | 2 same, 768 | 3 2 vectors, 512
             | 4, 5 4 vectors/thread (a warp per row at hidden <= 1024), 384 threads/SM, 3 / 2 stages
             | 6 variant 3 with row-group barriers | 7 variant 3 with the row kept in registers | 8, 9 variant 7
             in blocks of >= 128 threads / of one row

1. correctness (PASS/FAIL per variant): rows 1, 17, 1000 x hidden 8, 1000, 1024, 4096, 16384, bf16, with and
   without residual / weight / bias / dropout, LayerNorm and RMSNorm, plus fp32 and fp16 spot checks; forward
   (y, h, mean, rstd; h and the dropout mask bit-exact) and backward (dres, dx, dw, db) against
   tk_inductor.ops.layernorm.reference_*; the backward run twice must agree bit for bit.
2. timing: rows 65536 x hidden 1024/2048/4096/8192, bf16, h = x + residual, LayerNorm with w and b, forward
   (y, h, and mean/rstd: the training forward, as the baseline's) and backward (dy, dh -> dres, dw, db);
   median of CUDA-event-timed runs (triton do_bench, L2 cleared),
   GB/s over minimal bytes (forward: x, r, y, h, w, b; backward: dy, dh, h, dres, w, dw, db). Baseline:
   torch.compile (default mode) of the same eager code, its training graph's forward and autograd backward,
   timed after all of ours, sizes in COMPILE_ORDER until the time budget (--budget-s) is spent.

    python -m benchmarks.sweep_ln [--variants-fwd 0,...,8] [--variants-bwd 0,...,9] [--no-compile]

Prints one table, writes $OUT/sweep_ln.json (OUT defaults to ".").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .common import no_gpu

ROWS = 65536
HIDDEN = (1024, 2048, 4096, 8192)
COMPILE_ORDER = (1024, 4096, 8192, 2048)
EPS = 1e-5
FWD_VARIANTS = (0, 1, 2, 3, 4, 5, 6, 7, 8)
BWD_VARIANTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def log(msg: str) -> None:
    print(f"[sweep_ln {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextmanager
def variants(fwd: int | None = None, bwd: int | None = None):
    """Select the kernel variants for the calls inside (the binding reads the environment per call)."""
    saved = {k: os.environ.get(k) for k in ("TK_LN_FWD_VARIANT", "TK_LN_BWD_VARIANT")}
    try:
        if fwd is not None:
            os.environ["TK_LN_FWD_VARIANT"] = str(fwd)
        if bwd is not None:
            os.environ["TK_LN_BWD_VARIANT"] = str(bwd)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.isnan(a).any():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def poison(*like) -> None:
    """NaN-filled free blocks of these sizes in the caching allocator: elements a kernel fails to write show as NaN."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in like]
    del blocks


# ---------------------------------------------------------------------------- correctness

def correctness_cases():
    """(rows, hidden, dtype, residual, weight, bias, p, rms)."""
    for rows in (1, 17, 1000):
        for hidden in (8, 1000, 1024, 4096, 16384):
            yield rows, hidden, torch.bfloat16, True, True, True, 0.0, False
            yield rows, hidden, torch.bfloat16, False, False, False, 0.0, False
            yield rows, hidden, torch.bfloat16, True, True, False, 0.0, True
            yield rows, hidden, torch.bfloat16, True, True, True, 0.1, False
            yield rows, hidden, torch.bfloat16, False, True, False, 0.1, True
    for dtype in (torch.float32, torch.float16):
        for rows, hidden in ((17, 1000), (1000, 4096), (3, 16384)):
            yield rows, hidden, dtype, True, True, True, 0.0, False
            yield rows, hidden, dtype, True, True, False, 0.2, True


def check_case(fwd_v, bwd_v, rows, hidden, dtype, residual, weight, bias, p, rms) -> str | None:
    """None when the variants match the reference on this case, else what went wrong."""
    from tk_inductor.ops import layernorm as ln_ops

    g = torch.Generator(device="cuda").manual_seed(rows * 7919 + hidden)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    x = mk(rows, hidden)
    r = mk(rows, hidden) if residual else None
    w = mk(hidden) if weight else None
    b = mk(hidden) if bias else None
    rng = torch.tensor([0x0123456789ABCDEF + hidden, 977 + rows], dtype=torch.int64) if p > 0 else None
    tol = TOL[dtype]
    with variants(fwd_v, bwd_v):
        poison(((rows, hidden), dtype), ((rows, hidden), dtype), ((rows,), torch.float32), ((rows,), torch.float32))
        y, h, mean, rstd, rng_out = torch.ops.tk_cuda.layernorm(x, r, w, b, rng, EPS, p, rms)
        ye, he, me, re_, _ = ln_ops.reference_forward(x, r, w, b, rng, EPS, p, rms)
        if rel_err(y, ye) > tol:
            return f"fwd y rel err {rel_err(y, ye):.2e}"
        if rel_err(rstd, re_) > 1e-5:
            return f"fwd rstd rel err {rel_err(rstd, re_):.2e}"
        if not rms and (torch.isnan(mean).any() or (mean - me).abs().max().item() > 1e-4 * max(1.0, me.abs().max().item())):
            return "fwd mean differs"
        if he.numel() and not torch.equal(h, he):
            return "fwd h not bit-exact (residual add or dropout mask)"
        stored = he.numel() > 0
        hh = h if stored else x
        g2 = torch.Generator(device="cuda").manual_seed(rows + hidden)
        dy = torch.randn(rows, hidden, generator=g2, device="cuda").to(dtype)
        dh = torch.randn(rows, hidden, generator=g2, device="cuda").to(dtype) if stored else None
        poison(((rows, hidden), dtype), ((rows, hidden), dtype), ((hidden,), dtype), ((hidden,), dtype))
        out = torch.ops.tk_cuda.layernorm_backward(dy, dh, hh, w, mean, rstd, rng_out, p, rms, b is not None)
        ref = ln_ops.reference_backward(dy, dh, hh, w, mean, rstd, rng_out, p, rms, b is not None)
        for name, a, e in zip(("dres", "dx", "dw", "db"), out, ref):
            if a.shape != e.shape:
                return f"bwd {name} shape {tuple(a.shape)} != {tuple(e.shape)}"
            if e.numel():
                err = rel_err(a, e)
                # dw/db sum over rows in a different order than the reference: looser for 16-bit outputs
                if err > tol * (4 if name in ("dw", "db") else 1):
                    return f"bwd {name} rel err {err:.2e}"
        again = torch.ops.tk_cuda.layernorm_backward(dy, dh, hh, w, mean, rstd, rng_out, p, rms, b is not None)
        if not all(torch.equal(u, v) for u, v in zip(out, again)):
            return "bwd not deterministic"
    return None


def correctness(fwd_vs, bwd_vs) -> dict:
    """Each forward variant paired with each backward variant by position (the rest with the default)."""
    results = {}
    pairs = [(fwd_vs[i] if i < len(fwd_vs) else None, bwd_vs[i] if i < len(bwd_vs) else None)
             for i in range(max(len(fwd_vs), len(bwd_vs)))]
    for fwd_v, bwd_v in pairs:
        fails = []
        n = 0
        for case in correctness_cases():
            n += 1
            try:
                msg = check_case(fwd_v, bwd_v, *case)
            except Exception as exc:  # a launch error is a FAIL of this variant, not the end of the sweep
                msg = f"raised {type(exc).__name__}: {str(exc)[:200]}"
            if msg:
                rows, hidden, dtype, residual, weight, bias, p, rms = case
                fails.append(f"rows {rows} hidden {hidden} {str(dtype)[6:]} res={residual} w={weight} b={bias} "
                             f"p={p} rms={rms}: {msg}")
        key = f"fwd{fwd_v}/bwd{bwd_v}"
        results[key] = {"cases": n, "failures": fails}
        log(f"correctness {key}: {'PASS' if not fails else 'FAIL'} ({n - len(fails)}/{n})")
        for f in fails[:8]:
            log(f"    {f}")
    return results


# ---------------------------------------------------------------------------- which kernels ran

KERNEL_KEYS = ("forward_pipe_kernel", "forward_lean_kernel", "backward_pipe_kernel", "forward_kernel", "backward_kernel",
               "column_sum")


def short_kernel_name(name: str, us: float | None = None) -> str:
    """'forward_kernel[128x1/128] 12.3us' for a demangled kernel name: which kernel, its split (threads per row
    x vectors per thread / block; tells variants of one kernel apart) and its device time when known."""
    import re

    key = next((k for k in KERNEL_KEYS if k in name), name[:40])
    split = re.search(r"Split<(\d+), ?(\d+), ?(\d+)>", name)
    out = key + (f"[{split.group(1)}x{split.group(2)}/{split.group(3)}]" if split else "")
    return out + (f" {us:.1f}us" if us is not None else "")


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one call of fn launches, with split and device time (checks that a variant really took
    its path; the times show what the column sum costs next to the main kernel)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        short = []
        for e in prof.events():
            if e.device_type.name != "CUDA":
                continue
            try:
                us = float(e.time_range.elapsed_us())
            except Exception:  # the time is a diagnostic only
                us = None
            name = short_kernel_name(e.name, us)
            if name not in short:
                short.append(name)
        return short
    except Exception as exc:  # profiling is a diagnostic only
        return [f"profiler failed: {exc}"[:80]]


# ---------------------------------------------------------------------------- timing

def _eager(x, r, w, b):
    h = x + r
    return F.layer_norm(h, (h.shape[-1],), w, b, EPS), h


def _inputs(hidden):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)
    return mk(ROWS, hidden), mk(ROWS, hidden), mk(hidden), mk(hidden), mk(ROWS, hidden), mk(ROWS, hidden)


def _bytes(hidden):
    """Minimal bytes of the forward (x, r, y, h, w, b) and of the backward (dy, dh, h, dres, w, dw, db)."""
    return (4 * ROWS * hidden + 2 * hidden) * 2, (4 * ROWS * hidden + 3 * hidden) * 2


def _ms(fn):
    from .common import median_ms

    return median_ms(fn, warmup_ms=10, rep_ms=60)


def timing_ours(fwd_vs, bwd_vs, deadline: float) -> list[dict]:
    """Every variant at every size (checked against the reference first)."""
    from tk_inductor.ops import layernorm as ln_ops

    rows_out = []
    for hidden in HIDDEN:
        if time.time() > deadline:
            log(f"time budget spent: hidden {hidden} skipped")
            break
        rows_out.append(_time_ours_at(hidden, fwd_vs, bwd_vs, ln_ops))
        log(f"timed ours at hidden {hidden}")
        torch.cuda.empty_cache()  # the inputs of this size are gone with the call's frame
    return rows_out


def _check_and_time(entry: dict, side: str, v: int, fn, check, nbytes: float, hidden: int) -> None:
    """entry[side]["v<v>"]: GB/s of fn once check(fn()) passed, or the error; the launched kernels at the
    extreme sizes (a pipe variant that does not fit runs legacy)."""
    try:
        check(fn())
        t = _ms(fn)
        entry[side][f"v{v}"] = {"ms": t, "gbs": nbytes / t / 1e6}
        if hidden in (HIDDEN[0], HIDDEN[-1]):
            entry["kernels"][f"{side} v{v}"] = kernel_names(fn)
    except Exception as exc:
        entry[side][f"v{v}"] = {"error": str(exc)[:200]}


def _time_ours_at(hidden, fwd_vs, bwd_vs, ln_ops) -> dict:
    x, r, w, b, dy, dh = _inputs(hidden)
    fwd_bytes, bwd_bytes = _bytes(hidden)
    entry = {"hidden": hidden, "fwd": {}, "bwd": {}, "kernels": {}}
    y_ref, h_ref = _eager(x.float(), r.float(), w.float(), b.float())

    def check_fwd(out):
        err = max(rel_err(out[0], y_ref), rel_err(out[1], h_ref))
        if err > 1e-2:
            raise AssertionError(f"rel err {err:.2e}")

    with torch.no_grad():
        for v in fwd_vs:
            with variants(fwd=v):
                _check_and_time(entry, "fwd", v, lambda: torch.ops.tk_cuda.layernorm(x, r, w, b, None, EPS, 0.0, False),
                                check_fwd, fwd_bytes, hidden)
        _, h, mean, rstd, rng = torch.ops.tk_cuda.layernorm(x, r, w, b, None, EPS, 0.0, False)
        ref = ln_ops.reference_backward(dy, dh, h, w, mean, rstd, rng, 0.0, False, True)

        def check_bwd(out):
            for name, a, e in zip(("dres", "dx", "dw", "db"), out, ref):
                if e.numel() and rel_err(a, e) > 4e-2:
                    raise AssertionError(f"{name} rel err {rel_err(a, e):.2e}")

        for v in bwd_vs:
            with variants(bwd=v):
                _check_and_time(entry, "bwd", v,
                                lambda: torch.ops.tk_cuda.layernorm_backward(dy, dh, h, w, mean, rstd, rng, 0.0, False,
                                                                             True),
                                check_bwd, bwd_bytes, hidden)
    return entry


def timing_compile(entries: list[dict], deadline: float) -> None:
    """torch.compile default of the eager code, forward and autograd backward, added to entries."""
    from tk_inductor.ops import layernorm as ln_ops

    comp = torch.compile(_eager, dynamic=False)
    # the size the targets worry about first, in case the time budget runs out
    for entry in sorted(entries, key=lambda e: COMPILE_ORDER.index(e["hidden"])):
        hidden = entry["hidden"]
        if time.time() > deadline:
            log(f"time budget spent: torch.compile at hidden {hidden} skipped")
            entry["fwd"]["compile"] = entry["bwd"]["compile"] = {"error": "skipped: time budget"}
            continue
        _time_compile_at(comp, entry, ln_ops)
        log(f"timed torch.compile at hidden {hidden}")
        torch.cuda.empty_cache()


def _time_compile_at(comp, entry, ln_ops) -> None:
    """One compile per size (the training graph, forward and backward): its forward also saves the row
    statistics for the backward, a few KB next to the GBs of y and h."""
    hidden = entry["hidden"]
    x, r, w, b, dy, dh = _inputs(hidden)
    fwd_bytes, bwd_bytes = _bytes(hidden)
    xg, rg, wg, bg = (t_.detach().requires_grad_() for t_ in (x, r, w, b))
    try:
        y, h = comp(xg, rg, wg, bg)
        with torch.no_grad():
            y_ref, h_ref = _eager(x.float(), r.float(), w.float(), b.float())
            err = max(rel_err(y, y_ref), rel_err(h, h_ref))
        del y_ref, h_ref
        if err > 1e-2:
            raise AssertionError(f"forward rel err {err:.2e}")
        t = _ms(lambda: comp(xg, rg, wg, bg))
        entry["fwd"]["compile"] = {"ms": t, "gbs": fwd_bytes / t / 1e6}
    except Exception as exc:
        entry["fwd"]["compile"] = {"error": str(exc)[:200]}
    try:
        y, h = comp(xg, rg, wg, bg)
        bwd = lambda: torch.autograd.grad((y, h), (xg, rg, wg, bg), (dy, dh), retain_graph=True)
        grads = bwd()
        with torch.no_grad():
            _, hh, mean, rstd, rng = torch.ops.tk_cuda.layernorm(x, r, w, b, None, EPS, 0.0, False)
            dres_ref = ln_ops.reference_backward(dy, dh, hh, w, mean, rstd, rng, 0.0, False, True)[0]
        err = rel_err(grads[0], dres_ref)
        if err > 2e-2:
            raise AssertionError(f"backward dx rel err {err:.2e}")
        t = _ms(bwd)
        entry["bwd"]["compile"] = {"ms": t, "gbs": bwd_bytes / t / 1e6}
    except Exception as exc:
        entry["bwd"]["compile"] = {"error": str(exc)[:200]}


def table(timings: list[dict], ceiling: float, fwd_vs, bwd_vs) -> str:
    def cell(d):
        if d is None:
            return "-"
        if "error" in d:
            return "ERR"
        return f"{d['gbs']:.0f} ({100 * d['gbs'] / ceiling:.0f}%)"

    out = [f"copy ceiling {ceiling:.0f} GB/s; GB/s (% of copy), rows {ROWS}, bf16, LN + residual, w and b"]
    for direction, vs in (("fwd", fwd_vs), ("bwd", bwd_vs)):
        head = ["hidden"] + [f"{direction} v{v}" for v in vs] + ["compile", "best/compile"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|---" * len(head) + "|")
        for e in timings:
            d = e[direction]
            cells = [str(e["hidden"])] + [cell(d.get(f"v{v}")) for v in vs] + [cell(d.get("compile"))]
            ok = [d[f"v{v}"]["ms"] for v in vs if "ms" in d.get(f"v{v}", {})]
            comp = d.get("compile", {}).get("ms")
            cells.append(f"{comp / min(ok):.2f}" if ok and comp else "-")
            out.append("| " + " | ".join(cells) + " |")
    errors = [(e["hidden"], k, name, v["error"]) for e in timings for k in ("fwd", "bwd")
              for name, v in e[k].items() if "error" in v]
    for hidden, k, name, msg in errors:
        out.append(f"ERR hidden {hidden} {k} {name}: {msg}")
    for e in timings:
        if e.get("kernels"):
            out.append(f"kernels launched at hidden {e['hidden']}: " +
                       "; ".join(f"{k}: {'+'.join(v)}" for k, v in e["kernels"].items()))
    return "\n".join(out)


def main(argv=None) -> int:
    start = time.time()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sweep_ln", description=__doc__.splitlines()[0])
    ap.add_argument("--variants-fwd", default=",".join(map(str, FWD_VARIANTS)))
    ap.add_argument("--variants-bwd", default=",".join(map(str, BWD_VARIANTS)))
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop timing new sizes after this many seconds")
    args = ap.parse_args(argv)
    if (why := no_gpu()) is not None:
        print(f"python -m benchmarks.sweep_ln: {why}")
        return 2
    fwd_vs = [int(v) for v in args.variants_fwd.split(",") if v != ""]
    bwd_vs = [int(v) for v in args.variants_bwd.split(",") if v != ""]

    from tk_inductor import build

    from .common import copy_ceiling_gbs

    log("building / loading the layernorm kernels")
    build.load("layernorm")
    log(f"loaded after {time.time() - start:.1f} s")
    checks = correctness(fwd_vs, bwd_vs)
    log(f"correctness done after {time.time() - start:.1f} s")
    ceiling = copy_ceiling_gbs()
    timings = timing_ours(fwd_vs, bwd_vs, start + args.budget_s)
    if not args.no_compile:
        timing_compile(timings, start + args.budget_s)
    text = table(timings, ceiling, fwd_vs, bwd_vs)
    verdicts = [f"{k}: {'PASS' if not v['failures'] else 'FAIL (%d/%d failed)' % (len(v['failures']), v['cases'])}"
                for k, v in checks.items()]
    print("correctness: " + "; ".join(verdicts))
    for k, v in checks.items():
        for f in v["failures"][:5]:
            print(f"  FAIL {k}: {f}")
    print(text)
    print(f"total {time.time() - start:.1f} s")
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sweep_ln.json"), "w") as f:
        json.dump({"copy_ceiling_gbs": ceiling, "correctness": checks, "timing": timings,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "seconds": time.time() - start}, f, indent=1)
    return 0 if all(not v["failures"] for v in checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
