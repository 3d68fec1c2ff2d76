"""Where a backward step spends its GPU time: torch.profiler over a few steps, one table per case, sorted by CUDA
time. SSD and Based: forward+backward through the op's autograd (the kernels and the bindings' elementwise work);
layernorm: the raw backward (its main kernel and the dw/db column sum).

    python -m benchmarks.profile_backward [--ops ssd,linear_attention,layernorm] [--steps 5]

With --ncu the steps run between cudaProfilerStart/Stop instead, without torch.profiler, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python -m benchmarks.profile_backward --ops layernorm --steps 1 --ncu
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tk_inductor.ops import linear_attention, ssd  # noqa: F401  (register tk::linear_attention, tk::ssd)

from .common import backward_step

CASES = {  # the fwd+bwd rows of benchmarks/ssd.py and benchmarks/linear_attention.py
    "ssd": [(16, 4096, 80), (1, 4096, 32)],  # b, l, nh (p 64, n 128)
    "linear_attention": [(4, 16, 4096), (16, 16, 4096)],  # B, H, N (dk 16, dv 64)
    "layernorm": [(65536, 1024), (65536, 2048), (65536, 4096), (65536, 8192)],  # rows, hidden (LN, w and b)
}


def ssd_step(b, l, nh):
    from .ssd import inputs

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


STEPS = {"ssd": ssd_step, "linear_attention": based_step, "layernorm": layernorm_step}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="ssd,linear_attention")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--ncu", action="store_true", help="no torch.profiler: the steps between cudaProfilerStart/Stop")
    args = p.parse_args(argv)
    from tk_inductor import build

    for op in args.ops.split(","):
        build.load(op)
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
