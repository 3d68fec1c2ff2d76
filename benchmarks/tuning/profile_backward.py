"""Where a backward step spends its GPU time: torch.profiler over a few steps, one table per case, sorted by CUDA
time. SSD and Based: forward+backward through the op's autograd (the kernels and the bindings' elementwise work);
layernorm: the raw backward (its main kernel and the dw/db column sum).

    python -m benchmarks.tuning.profile_backward [--ops ssd,linear_attention,layernorm] [--steps 5]

With --timeline the steps run as triton's do_bench runs them (L2 flushed by a 256 MB memset, then an event pair
around the step) under torch.profiler, and each kernel's median duration and the median gap before it are printed
next to the events' median time: where a step's time goes besides its kernels.

With --ncu the steps run between cudaProfilerStart/Stop instead, without torch.profiler, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python -m benchmarks.tuning.profile_backward --ops layernorm --steps 1 --ncu
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from tk_inductor.ops import linear_attention, ssd  # noqa: F401  (register tk::linear_attention, tk::ssd)

from ..common import backward_step

CASES = {  # the fwd+bwd rows of benchmarks/ssd.py and benchmarks/linear_attention.py
    "ssd": [(16, 4096, 80), (1, 4096, 32)],  # b, l, nh (p 64, n 128)
    "linear_attention": [(4, 16, 4096), (16, 16, 4096)],  # B, H, N (dk 16, dv 64)
    "layernorm": [(65536, 1024), (65536, 2048), (65536, 4096), (65536, 8192)],  # rows, hidden (LN, w and b)
}
CASES["layernorm_fwd"] = CASES["copy"] = CASES["layernorm"][:1]
FAMILY = {"layernorm_fwd": "layernorm", "copy": None}  # the kernel family an op's steps need (default: the op's)


def ssd_step(b, l, nh):
    from ..ssd import inputs

    leaves = [t.requires_grad_() for t in inputs(b, l, nh, 64, 128)]
    x, dt, A, B, C, D = leaves
    return backward_step(lambda: torch.ops.tk.ssd(x, dt, A, B, C, D, None, 64)[0], leaves, torch.randn_like(x), x)


def based_step(B, H, N):
    leaves = [torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for d in (16, 16, 64)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    do = torch.randn(B, H, N, 64, device="cuda", dtype=torch.bfloat16)
    return backward_step(lambda: torch.ops.tk.linear_attention(q, k, v, "based", None, None, 0.25, True, 1e-6),
                         leaves, do, leaves[0])


def layernorm_step(rows, hidden):
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    x, r, w, b, dy, dh = mk(rows, hidden), mk(rows, hidden), mk(hidden), mk(hidden), mk(rows, hidden), mk(rows, hidden)
    _, h, mean, rstd, rng = torch.ops.tk_cuda.layernorm(x, r, w, b, None, 1e-5, 0.0, False)
    return lambda: torch.ops.tk_cuda.layernorm_backward(dy, dh, h, w, mean, rstd, rng, 0.0, False, True)


def layernorm_fwd_step(rows, hidden):
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    x, r, w, b = mk(rows, hidden), mk(rows, hidden), mk(hidden), mk(hidden)
    return lambda: torch.ops.tk_cuda.layernorm(x, r, w, b, None, 1e-5, 0.0, False, False)  # inference: no stats


def copy_step(rows, hidden):
    src = torch.randn(2 * rows, hidden, device="cuda", dtype=torch.bfloat16)  # the LN backward's bytes, 1:1
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


STEPS = {"ssd": ssd_step, "linear_attention": based_step, "layernorm": layernorm_step,
         "layernorm_fwd": layernorm_fwd_step, "copy": copy_step}


def iterations(kernels: list, steps: int) -> list[list]:
    """`steps` iterations' kernels in start order, one list per iteration: each launches the same kernels, the
    flush first (told apart by position, not by name: a step may run elementwise kernels of its own)."""
    if not kernels or len(kernels) % steps:
        raise RuntimeError(f"{len(kernels)} kernels recorded in {steps} steps: not the same kernels every step")
    n = len(kernels) // steps
    return [kernels[i * n:(i + 1) * n] for i in range(steps)]


def timeline(step, steps: int) -> str:
    """Median duration of each kernel of a step and of the gap before it (the first kernel's gap is from the end
    of the L2-flush memset), against the median event time of the step, as do_bench measures it."""
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for start, end in pairs:
            flush.zero_()
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0),
                     key=lambda e: e.time_range.start)
    iters = iterations(kernels, steps)
    lines = [f"event time (median of {steps}): {statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3:.1f} us"]
    n = min(len(it) for it in iters)
    for k in range(1, n):
        gap = statistics.median(it[k].time_range.start - it[k - 1].time_range.end for it in iters)
        dur = statistics.median(it[k].time_range.elapsed_us() for it in iters)
        lines.append(f"  gap {gap:7.1f} us, then {dur:8.1f} us  {iters[0][k].name[:90]}")
    span = statistics.median(it[n - 1].time_range.end - it[0].time_range.end for it in iters)
    lines.append(f"  flush end to last kernel end: {span:.1f} us")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="ssd,linear_attention")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--ncu", action="store_true", help="no torch.profiler: the steps between cudaProfilerStart/Stop")
    p.add_argument("--timeline", action="store_true", help="kernel durations and the gaps between them, do_bench style")
    args = p.parse_args(argv)
    from tk_inductor import build

    for op in args.ops.split(","):
        if (family := FAMILY.get(op, op)) is not None:
            build.load(family)
        for case in CASES[op]:
            step = STEPS[op](*case)
            step(), torch.cuda.synchronize()  # warm-up: first launches, allocator
            if args.ncu:
                torch.cuda.cudart().cudaProfilerStart()
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"== {op} {case}: {args.steps} steps under Nsight Compute")
                del step
                continue
            if args.timeline:
                print(f"== {op} {case}: {args.steps} do_bench-style steps")
                print(timeline(step, args.steps))
                del step
                torch.cuda.empty_cache()
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
            print(f"== {op} {case}: {args.steps} fwd+bwd steps")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
            del step
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
