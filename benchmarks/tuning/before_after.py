"""The default kernels of two source trees timed side by side in one session: did a change keep their speed?

    python -m benchmarks.tuning.before_after --tree old=/path/to/checkout --tree new=. [--rounds 3] [--only fwd+bwd]

Each tree is a checkout of this repository with its kernels built (`python -m tk_inductor build`, into the cache
its `TK_INDUCTOR_CACHE_DIR` names: give it as `--tree old=PATH:CACHE`). Each round runs every tree once, each in its
own process that imports that tree's tk_inductor; the order alternates from round to round. A case's time is the
median over rounds of its per-process median (triton's do_bench, 300 ms). Only the raw `tk_cuda::` ops and the
`tk::ssd` / `tk::linear_attention` autograd ops are called, in argument forms every tree since c4cb903 accepts.

Cases: attention D128/D64 at N4096 (65536 tokens, hidden 2048, causal and full, forward and backward), the
layernorm and rmsnorm with residual at 65536 x 1024/4096 (inference and training forward, backward), rotary (Llama
q/k, B8 N4096), the SSD (Mamba-2 2.7B layer and a 32-head layer) and Based (B8/B16 H16 N4096 F16 dv64), forward and
forward+backward.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def measure(root: str, label: str, out: str, only: str) -> None:
    """Time every case with the tk_inductor of `root`; append one JSON line per case to `out`. (benchmarks.common's
    median_ms and warm_up are not used: that module imports tk_inductor, which must come from `root`.)"""
    sys.path.insert(0, root)
    import torch
    from triton.testing import do_bench

    import tk_inductor
    from tk_inductor import build
    from tk_inductor.ops import linear_attention, ssd  # noqa: F401 (register tk::linear_attention, tk::ssd)

    assert tk_inductor.__file__.startswith(os.path.abspath(root)), tk_inductor.__file__
    for family in ("attention", "layernorm", "rotary", "ssd", "linear_attention"):
        build.load(family)
    dev, bf = "cuda", torch.bfloat16
    rows = []

    def timed(name, fn):
        if only not in name:
            return
        try:
            ms = float(do_bench(fn, warmup=25, rep=300, return_mode="median"))
        except Exception as exc:  # noqa: BLE001 (a case a tree cannot run is reported, not fatal)
            rows.append({"tree": label, "case": name, "ms": None, "error": f"{type(exc).__name__}: {exc}"[:300]})
            return
        rows.append({"tree": label, "case": name, "ms": ms})
        print(f"{label:6s} {name:46s} {ms:8.4f} ms", flush=True)

    def step(fn, leaves, dy):
        def run():
            for t in leaves:
                t.grad = None
            fn().backward(dy)
        return run

    a = torch.randn(4096, 4096, device=dev, dtype=bf)  # clocks up before the first case
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, dtype=bf, scale=1.0):
        return torch.randn(*shape, device=dev, generator=g).mul_(scale).to(dtype)

    for D in (128, 64):
        B, H, N = 16, 2048 // D, 4096
        q, k, v, do = (rand(B, H, N, D) for _ in range(4))
        for causal in (False, True):
            tag = f"attention D{D} N{N} {'causal' if causal else 'full'}"
            timed(tag + " fwd", lambda: torch.ops.tk_cuda.attention(q, k, v, causal, D ** -0.5))
            o, lse = torch.ops.tk_cuda.attention(q, k, v, causal, D ** -0.5)
            timed(tag + " bwd", lambda: torch.ops.tk_cuda.attention_backward(do, q, k, v, o, lse, causal, D ** -0.5))
    for hidden in (1024, 4096):
        for rms in (True, False):
            x, r, dy = (rand(65536, hidden) for _ in range(3))
            w, b = rand(hidden), None if rms else rand(hidden)
            tag = f"{'rmsnorm' if rms else 'layernorm'}+residual {hidden}"
            ln = torch.ops.tk_cuda.layernorm
            timed(tag + " fwd (inference)", lambda: ln(x, r, w, b, None, 1e-5, 0.0, rms, False))
            timed(tag + " fwd (training)", lambda: ln(x, r, w, b, None, 1e-5, 0.0, rms))
            _, h, mean, rstd, rng = ln(x, r, w, b, None, 1e-5, 0.0, rms)
            timed(tag + " bwd", lambda: torch.ops.tk_cuda.layernorm_backward(dy, dy, h, w, mean, rstd, rng, 0.0, rms,
                                                                             b is not None))
    q, k = rand(8, 32, 4096, 128), rand(8, 8, 4096, 128)
    angle = rand(8, 1, 4096, 128, dtype=torch.float32)
    cos, sin = angle.cos().to(bf), angle.sin().to(bf)
    for backward in (False, True):
        timed(f"rotary B8 N4096 Hq32 Hk8 D128 {'bwd' if backward else 'fwd'}",
              lambda: torch.ops.tk_cuda.rotary(q, k, cos, sin, False, backward, False))
    for b, nh in ((16, 80), (1, 32)):
        l, p, n = 4096, 64, 128
        x = rand(b, l, nh, p)
        dt = torch.nn.functional.softplus(rand(b, l, nh, dtype=torch.float32) - 1.0)
        A = -torch.rand(nh, generator=g, device=dev) * 2 - 0.05
        Bm, C, D = rand(b, l, 1, n, scale=n ** -0.5), rand(b, l, 1, n), rand(nh, dtype=torch.float32)
        tag = f"ssd b{b} l{l} nh{nh} p{p} n{n}"
        timed(tag + " fwd", lambda: torch.ops.tk_cuda.ssd(x, dt, A, Bm, C, D, None, 64))
        leaves = [t.requires_grad_() for t in (x, dt, A, Bm, C, D)]
        timed(tag + " fwd+bwd", step(lambda: torch.ops.tk.ssd(*leaves, None, 64)[0], leaves, torch.randn_like(x)))
    for B in (8, 16):
        q, k, v = rand(B, 16, 4096, 16, scale=0.25), rand(B, 16, 4096, 16, scale=0.25), rand(B, 16, 4096, 64)
        tag = f"based B{B} H16 N4096 F16 dv64"
        timed(tag + " fwd", lambda: torch.ops.tk_cuda.linear_attention(q, k, v, "based", None, None, 0.25, True, 1e-6))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        timed(tag + " fwd+bwd", step(lambda: torch.ops.tk.linear_attention(*leaves, "based", None, None, 0.25, True,
                                                                          1e-6), leaves, torch.randn_like(v)))
    with open(out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def table(path: str, labels: list[str]) -> str:
    times = collections.defaultdict(list)
    errors = {}
    for line in open(path):
        row = json.loads(line)
        if row["ms"] is None:
            errors[(row["case"], row["tree"])] = row["error"]
        else:
            times[(row["case"], row["tree"])].append(row["ms"])
    first, last = labels[0], labels[-1]
    out = [f"{'case':46s} " + " ".join(f"{lb:>10s}" for lb in labels) + f"  speed {last}/{first}"]
    for case in dict.fromkeys(c for c, _ in list(times) + list(errors)):
        ms = [statistics.median(times[(case, lb)]) if times.get((case, lb)) else None for lb in labels]
        cells = " ".join(f"{m:10.4f}" if m is not None else f"{'error':>10s}" for m in ms)
        ratio = f"  {ms[0] / ms[-1]:.3f}x" if ms[0] and ms[-1] else ""
        out.append(f"{case:46s} {cells}{ratio}")
    out += [f"{tree} {case}: {err}" for (case, tree), err in errors.items()]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="LABEL=PATH[:CACHE], two or more, oldest first")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="only the cases whose name contains this")
    ap.add_argument("--out", default=None, help="JSON lines of every measurement (default: a temporary file)")
    ap.add_argument("--measure", nargs=3, metavar=("ROOT", "LABEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        measure(*args.measure, args.only)
        return 0
    trees = []
    for spec in args.tree:
        label, _, where = spec.partition("=")
        root, _, cache = where.partition(":")
        trees.append((label, os.path.abspath(root), os.path.abspath(cache) if cache else None))
    out = args.out or tempfile.mkstemp(suffix=".jsonl")[1]
    open(out, "w").close()
    for r in range(args.rounds):
        for label, root, cache in trees if r % 2 == 0 else trees[::-1]:
            env = dict(os.environ, **({"TK_INDUCTOR_CACHE_DIR": cache} if cache else {}))
            cmd = [sys.executable, "-m", "benchmarks.tuning.before_after", "--tree", "-", "--only", args.only,
                   "--measure", root, label, out]
            subprocess.run(cmd, env=env, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                os.path.abspath(__file__)))))
    print(table(out, [t[0] for t in trees]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
