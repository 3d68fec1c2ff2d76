"""bf16 GEMM: tk::gemm (LCSF, persistent, supergrouped) vs torch.matmul (cuBLAS), side by side,
plus the input-pipeline-depth ablation (1-4 stages, like Table 1 of the ThunderKittens paper).

    python benchmarks/gemm.py [--sizes 4096,8192] [--json out.json]

Median of triton.testing.do_bench; TFLOPS = 2 M N K / time. Each shape is checked against an fp32
matmul before timing.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def tflops(m, n, k, ms):
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,8192", help="square sizes M=N=K, comma-separated")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gemm.py needs a CUDA device", file=sys.stderr)
        return 1
    from triton.testing import do_bench

    from tk_inductor import build
    from tk_inductor.ops import gemm

    build.load("gemm")
    results = []
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| M=N=K | cuBLAS TFLOPS | tk 1 stage | tk 2 stages | tk 3 stages | tk 4 stages (default) | ratio (4 st / cuBLAS) |")
    print("|---|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        row = {"size": size}
        row["cublas"] = tflops(size, size, size, do_bench(lambda: torch.matmul(a, b), warmup=100, rep=500, return_mode="median"))
        for n in (1, 2, 3, 4):
            c = gemm.stages(a, b, n)
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print(f"{size}: {n} stages: relative error {err:.3g}: WRONG RESULT", file=sys.stderr)
                return 1
            row[f"tk_{n}"] = tflops(size, size, size,
                                    do_bench(lambda: gemm.stages(a, b, n), warmup=100, rep=500, return_mode="median"))
        row["tk_op"] = tflops(size, size, size, do_bench(lambda: torch.ops.tk.gemm(a, b), warmup=100, rep=500,
                                                         return_mode="median"))
        row["ratio"] = row["tk_4"] / row["cublas"]
        results.append(row)
        print(f"| {size} | {row['cublas']:.0f} | {row['tk_1']:.0f} | {row['tk_2']:.0f} | {row['tk_3']:.0f} | "
              f"{row['tk_4']:.0f} (op {row['tk_op']:.0f}) | {row['ratio']:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
