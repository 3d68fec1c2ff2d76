"""bf16 GEMM: tk::gemm (LCSF, persistent, supergrouped) vs torch.matmul (cuBLAS), side by side,
plus the input-pipeline-depth ablation (1-4 stages, like Table 1 of the ThunderKittens paper).

    python -m benchmarks.gemm [--sizes 4096,8192] [--json out.json]

Median of triton.testing.do_bench; TFLOPS = 2 M N K / time. Each shape is checked against an fp32
matmul before timing.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

if __package__ in (None, ""):  # run as a script: make the repo importable without an install
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))


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
    configs = [(n, False) for n in (1, 2, 3, 4)] + [(n, True) for n in (1, 2, 3)]
    names = [f"{n} st{' +tma-store' if t else ''}" for n, t in configs]
    print("TFLOPS, median of do_bench. 'N st' = N-stage input ring, register epilogue; '+tma-store' = staged TMA-store epilogue")
    print("| M=N=K | cuBLAS | " + " | ".join(names) + " | tk::gemm (default) | best / cuBLAS |")
    print("|---" * (len(names) + 4) + "|")
    for size in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        row = {"size": size}
        row["cublas"] = tflops(size, size, size, do_bench(lambda: torch.matmul(a, b), warmup=100, rep=500, return_mode="median"))
        for (n, tma_store), name in zip(configs, names):
            c = gemm.stages(a, b, n, tma_store)
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print(f"{size}: {name}: relative error {err:.3g}: WRONG RESULT", file=sys.stderr)
                return 1
            row[name] = tflops(size, size, size, do_bench(lambda: gemm.stages(a, b, n, tma_store), warmup=100, rep=500,
                                                          return_mode="median"))
        row["tk_op"] = tflops(size, size, size, do_bench(lambda: torch.ops.tk.gemm(a, b), warmup=100, rep=500,
                                                         return_mode="median"))
        row["ratio_default"] = row["tk_op"] / row["cublas"]
        row["ratio_best"] = max(row[n] for n in names) / row["cublas"]
        results.append(row)
        print(f"| {size} | {row['cublas']:.0f} | " + " | ".join(f"{row[n]:.0f}" for n in names) +
              f" | {row['tk_op']:.0f} ({row['ratio_default']:.3f}x) | {row['ratio_best']:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
