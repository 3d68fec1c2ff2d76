"""Shared measuring helpers (see the device METHOD: random bf16, warm-up, median, beyond L2).

Every op benchmark returns a list of `Row`s; the driver prints them as one
table and writes JSON and plots.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable

import torch

from tk_inductor._timing import median_ms_events  # noqa: F401  (the e2e benchmark's timer)

L2_BYTES = 60 * 2**20  # H200: 60 MiB; inputs in the benchmarks are far larger or rotated
# NVLink multicast stays off in every multi-GPU run (the device README: a program using it can put the host's GPUs
# out of service); set before NCCL starts, and passed to child processes.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off() -> None:
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


@dataclasses.dataclass
class Row:
    op: str  # family, e.g. "attention"
    case: str  # shape and variant, e.g. "B16 H16 N4096 D128 causal fwd"
    impl: str  # "ours", "cudnn", "torch.compile", ...
    ms: float | None  # median milliseconds; None when the implementation is missing
    figure: float | None = None  # TFLOPS or GB/s
    unit: str = ""  # "TFLOPS" or "GB/s"
    x: float | None = None  # abscissa for plots (sequence length, hidden size)
    note: str = ""  # e.g. "not installed", "failed: ..."


def no_gpu() -> str | None:
    """Why the GPU benchmarks cannot run here (no CUDA device, or not a Hopper one), or None."""
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (an H100/H200: the kernels are built for sm_90a)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs an sm_90 GPU, found {torch.cuda.get_device_name()}"
    return None


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def median_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of `fn` with CUDA events (triton's do_bench clears L2 between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def warm_up(ms: float = 1000) -> None:
    """Keep the GPU busy with matmuls for about `ms`: the first case of a fresh process otherwise runs while the
    clocks ramp up (a 65536 x 1024 norm step measured 0.45-0.67 ms there against 0.33 ms later)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def median_ms_rounds(fns: dict[str, Callable[[], object]], rounds: int = 3, rep_ms: float = 80) -> dict[str, float]:
    """Median of per-round medians (median_ms) of several implementations timed in turn, each round starting one
    later in the list: whichever runs right after the others' long stretch of tensor-core work (warmer, maybe at a
    lower clock) is not always the same one."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(median_ms(fns[name], warmup_ms=10, rep_ms=rep_ms))
    return {name: statistics.median(t) for name, t in times.items()}


def copy_ceiling_gbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def check_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2) -> None:
    """A case is timed only after its output matched the reference."""
    if torch.isnan(out).any():
        raise AssertionError(f"{name}: NaN in output")
    err = rel_error(out, ref)
    if err > tol:
        raise AssertionError(f"{name}: relative error {err:.2e} > {tol:.0e}")


def check_and_time(op: str, case: str, impls: dict[str, Callable[[], torch.Tensor]], ref: torch.Tensor, x: float,
                   unit: str, figure: Callable[[float], float], tol: float = 1e-2) -> list[Row]:
    """One row per implementation: checked against `ref`, then timed (figure(ms) in `unit`); one that fails or
    does not fit is a row with the reason instead of a number."""
    rows = []
    for impl, fn in impls.items():
        if impl in SKIPPED:
            rows.append(Row(op, case, impl, None, note="skipped (--skip)"))
            continue
        try:
            check_close(f"{impl} {case}", fn(), ref, tol)
            ms = median_ms(fn)
            rows.append(Row(op, case, impl, ms, figure(ms), unit, x))
        except Exception as exc:  # reported in the table (a baseline's Triton error too), never dropped
            rows.append(Row(op, case, impl, None, note=f"failed: {type(exc).__name__}: {str(exc)[:160]}"))
    return rows


def backward_step(fn: Callable[[], torch.Tensor], leaves, grad_out: torch.Tensor, of: torch.Tensor):
    """A forward+backward step to time: fn()'s output back-propagated with grad_out into fresh gradients of
    `leaves`; returns of.grad, the value checked against the reference's."""
    def step():
        for t in leaves:
            t.grad = None
        fn().backward(grad_out)
        return of.grad
    return step


def public_api_rows(op: str, case: str, fn: Callable, inputs: tuple, grads: tuple, fwd_bytes: int, step_bytes: int,
                    x: float | None = None, amp: torch.dtype | None = None, tol: float = 2e-2) -> list[Row]:
    """`fn` compiled through the public API, `backend="thunderkittens"` beside default torch.compile (dynamic=False),
    as a user would run it: the forward under no_grad and a forward+backward step (autograd of fn's outputs with
    `grads` into every input that requires grad), under `amp` autocast when given. What the backend swaps and what
    Inductor fuses around it both count. Each output and gradient is checked against eager before timing."""
    import tk_inductor

    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    autocast = lambda: torch.autocast("cuda", dtype=amp, enabled=amp is not None)

    def forward(run):
        with torch.no_grad(), autocast():
            return run(*inputs)

    def step(run):
        with autocast():
            outs = run(*inputs)
        return torch.autograd.grad(outs, leaves, grads)

    ref_out, ref_grads = forward(fn), step(fn)
    rows, timed, notes = [], {}, {}
    for impl, backend in (("thunderkittens", "thunderkittens"), ("torch.compile", "inductor")):
        tk_inductor.reset()
        compiled = torch.compile(fn, backend=backend, dynamic=False)  # Dynamo keeps one entry per backend
        try:
            for got, want in zip(forward(compiled), ref_out):
                check_close(f"{impl} {case} forward", got, want, tol)
            for got, want in zip(step(compiled), ref_grads):
                check_close(f"{impl} {case} gradient", got, want, tol)
            notes[impl] = str(tk_inductor.report()).replace("\n", " | ") if impl == "thunderkittens" else ""
            timed[f"{impl} fwd"] = lambda c=compiled: forward(c)
            timed[f"{impl} fwd+bwd"] = lambda c=compiled: step(c)
        except Exception as exc:  # reported, never dropped
            rows.append(Row(op, f"{case} public", impl, None, note=f"failed: {type(exc).__name__}: {str(exc)[:160]}"))
    # Interleaved rounds: at these sizes a step can be bound by the CPU issuing it, which drifts over a run.
    for name, ms in median_ms_rounds(timed).items():
        impl, phase = name.rsplit(" ", 1)
        nbytes = fwd_bytes if phase == "fwd" else step_bytes
        rows.append(Row(op, f"{case} public {phase}", impl, ms, nbytes / ms / 1e6, "GB/s", x, note=notes[impl]))
    torch._dynamo.reset()
    return rows


def inductor_as_our_backend_runs_it() -> None:
    """The torch work-arounds our backend applies before Inductor (tk_inductor._compat: torch 2.11's CantSplit fix,
    split scans off), so a torch.compile baseline measures Inductor's kernels, not its bugs."""
    from tk_inductor import _compat

    _compat.apply()
    _compat.disable_split_scans()


def with_attr(obj, name: str, value, fn: Callable[[], object]):
    """fn() with obj.name set to value (e.g. a module's BACKWARD_KERNEL_VALIDATED, read when the backward runs),
    then restored."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        return fn()
    finally:
        setattr(obj, name, old)


# Implementations check_and_time leaves out (`--skip`): a baseline that takes minutes to compile or autotune.
SKIPPED: set[str] = set()


def op_main(prog: str, doc: str, run: Callable[[bool], list[Row]], argv=None, quick_help: str = "one shape") -> int:
    """`python -m benchmarks.<op> [--quick] [--skip NAME,...]`: run one op's benchmark and print its table."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--skip", default="", metavar="NAME,...",
                   help="implementations to leave out, e.g. torch.compile (their rows say skipped)")
    args = p.parse_args(argv)
    SKIPPED.update(name for name in args.skip.split(",") if name)
    print(table(run(args.quick)))
    return 0


def table(rows: list[Row]) -> str:
    """One line per (op, case): ours, each other implementation, and ours/baseline as a speed ratio."""
    by_case: dict[tuple[str, str], dict[str, Row]] = defaultdict(dict)
    for r in rows:
        by_case[(r.op, r.case)][r.impl] = r
    lines = []
    for (op, case), impls in by_case.items():
        ours = impls.get("ours") or impls.get("thunderkittens")
        parts = []
        for name, r in impls.items():
            if r.ms is None:
                parts.append(f"{name}: {r.note or 'missing'}")
                continue
            fig = f" {r.figure:.0f} {r.unit}" if r.figure is not None else ""
            ratio = ""
            if ours is not None and ours.ms and r is not ours:
                ratio = f" (ours {r.ms / ours.ms:.2f}x)"
            parts.append(f"{name} {r.ms:.3f} ms{fig}{ratio}")
        lines.append(f"{op:<10} {case:<40} " + " | ".join(parts))
    return "\n".join(lines)


def bandwidth_table(rows: list[Row], baselines: list[str]) -> str:
    """Markdown table for memory-bound ops: ours in GB/s and % of the copy ceiling (a row with impl "copy"),
    each baseline's GB/s, and ours/baseline."""
    ceiling = next((r.figure for r in rows if r.impl == "copy"), None)
    by_case: dict[str, dict[str, Row]] = {}
    for r in rows:
        if r.impl != "copy":
            by_case.setdefault(r.case, {})[r.impl] = r

    def fig(r):
        return f"{r.figure:.0f}" if r is not None and r.figure is not None else (r.note if r is not None else "-")

    def ratio(o, b):
        return f"{b.ms / o.ms:.2f}" if o and b and o.ms and b.ms else "-"

    head = ["case", "ours GB/s", "% of copy"] + [f"{b} GB/s" for b in baselines] + [f"ours/{b}" for b in baselines]
    out = [f"copy ceiling: {ceiling:.0f} GB/s" if ceiling else "copy ceiling: -",
           "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for case, impls in by_case.items():
        o = impls.get("ours")
        pct = f"{100 * o.figure / ceiling:.0f}%" if o and o.figure and ceiling else "-"
        cells = [case, fig(o), pct] + [fig(impls.get(b)) for b in baselines] + [ratio(o, impls.get(b)) for b in baselines]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
