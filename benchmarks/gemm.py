"""bf16 GEMM: tk::gemm (LCSF, persistent, supergrouped) vs torch.matmul (cuBLAS), side by side,
plus the ablation over input-pipeline depth (1-4 stages, like Table 1 of the ThunderKittens paper), epilogue
(registers -> global, or staged TMA store) and wgmma overlap.

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


def run(quick: bool = False) -> list:
    """tk::gemm (default config) vs cuBLAS as rows for `python -m benchmarks`; the ablation stays in main()."""
    from triton.testing import do_bench

    from benchmarks.common import Row, check_close, progress
    from tk_inductor import build
    from tk_inductor.ops import gemm  # noqa: F401  (registers tk::gemm)

    build.load("gemm")
    rows = []
    for size in (4096,) if quick else (4096, 8192):
        progress(f"gemm {size}^3")
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        check_close(f"gemm {size}", torch.ops.tk.gemm(a, b), a.float() @ b.float())
        for impl, fn in (("ours", lambda: torch.ops.tk.gemm(a, b)), ("cublas", lambda: torch.matmul(a, b))):
            ms = do_bench(fn, warmup=100, rep=500, return_mode="median")
            rows.append(Row("gemm", f"{size}^3", impl, ms, tflops(size, size, size, ms), "TFLOPS", x=size))
    return rows


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
    configs = gemm.CONFIGS
    names = [f"{n}st{' tma' if t else ''}{' ovl' if o else ''}" for n, t, o in configs]
    print("TFLOPS, median of do_bench. 'Nst' = N-stage input ring with the register epilogue; 'tma' = staged TMA-store "
          "epilogue; 'ovl' = one k-block of wgmmas kept in flight")
    print("| M=N=K | cuBLAS | " + " | ".join(names) + " | tk::gemm (default) | best / cuBLAS |")
    print("|---" * (len(names) + 4) + "|")
    best_name = None
    for size in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        row = {"size": size}
        row["cublas"] = tflops(size, size, size, do_bench(lambda: torch.matmul(a, b), warmup=100, rep=500, return_mode="median"))
        for cfg, name in zip(configs, names):
            c = gemm.configured(a, b, *cfg)
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print(f"{size}: {name}: relative error {err:.3g}: WRONG RESULT", file=sys.stderr)
                return 1
            row[name] = tflops(size, size, size, do_bench(lambda: gemm.configured(a, b, *cfg), warmup=50, rep=300,
                                                          return_mode="median"))
        row["tk_op"] = tflops(size, size, size, do_bench(lambda: torch.ops.tk.gemm(a, b), warmup=100, rep=500,
                                                         return_mode="median"))
        row["ratio_default"] = row["tk_op"] / row["cublas"]
        best_name = max(names, key=lambda n: row[n])
        row["best"] = best_name
        row["ratio_best"] = row[best_name] / row["cublas"]
        results.append(row)
        print(f"| {size} | {row['cublas']:.0f} | " + " | ".join(f"{row[n]:.0f}" for n in names) +
              f" | {row['tk_op']:.0f} ({row['ratio_default']:.3f}x) | {row['ratio_best']:.3f} ({best_name}) |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
