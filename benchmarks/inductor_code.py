"""What torch.compile's baseline does for the layernorm forward: the Triton kernels Inductor generates (their
source, with the launch configuration Inductor chose) and their device time next to ours, in one profile.
For the cases where the baseline is close to ours (hidden 1024: 0.99x), to see what it does differently.

    python -m benchmarks.inductor_code [--hidden 1024] [--out FILE]

Prints the kernel times; writes the generated code to FILE (default $OUT/inductor_code_<hidden>.py).
"""
from __future__ import annotations

import argparse
import os

import torch

from .common import no_gpu


def kernel_times(fn, reps: int = 20) -> dict[str, tuple[float, str]]:
    """Median device time (us) per kernel name over `reps` calls of fn, with its grid, block and registers (from
    the profiler's trace)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name)).get("traceEvents", [])
    times: dict[str, list[float]] = {}
    shape: dict[str, str] = {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        name, args = e["name"][:90], e.get("args", {})
        times.setdefault(name, []).append(float(e.get("dur", 0.0)))
        shape[name] = f"grid {args.get('grid')} block {args.get('block')} regs {args.get('registers per thread')}"
    return {k: (sorted(v)[len(v) // 2], shape[k]) for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inductor_code", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if no_gpu():
        print("no CUDA device: nothing to do")
        return 0
    from torch._inductor.utils import run_and_get_code

    from tk_inductor import build

    from .sweep_ln import _eager, variants

    build.load("layernorm")
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)
    x, r, w, b = mk(args.rows, args.hidden), mk(args.rows, args.hidden), mk(args.hidden), mk(args.hidden)
    compiled = torch.compile(_eager, dynamic=False)
    with torch.no_grad():
        _, code = run_and_get_code(compiled, x, r, w, b)
        out = args.out or os.path.join(os.environ.get("OUT", "."), f"inductor_code_{args.hidden}.py")
        with open(out, "w") as f:
            f.write("\n\n# ----\n\n".join(code))
        print(f"generated code: {out}")
        rows = [("torch.compile", kernel_times(lambda: compiled(x, r, w, b)))]
        for v in (0, 4, 5, 7, 8):
            with variants(fwd=v):
                rows.append((f"ours v{v}", kernel_times(lambda: torch.ops.tk_cuda.layernorm(x, r, w, b, None, 1e-5, 0.0, False))))
    for who, times in rows:
        for name, (us, shape) in times.items():
            print(f"{who:14s} {us:8.1f} us  {shape}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
