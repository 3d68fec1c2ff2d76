"""Where a forward+backward step of the SSD or Based op spends its GPU time: torch.profiler over a few steps through
the op's autograd (the kernels and the bindings' elementwise work), one table per case, sorted by CUDA time.

    python -m benchmarks.profile_backward [--ops ssd,linear_attention] [--steps 5]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="ssd,linear_attention")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=15)
    args = p.parse_args(argv)
    from tk_inductor import build

    for op in args.ops.split(","):
        build.load(op)
        for case in CASES[op]:
            step = (ssd_step if op == "ssd" else based_step)(*case)
            step(), torch.cuda.synchronize()  # warm-up: first launches, allocator
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
