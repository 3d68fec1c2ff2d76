"""Cold build of all kernels, cached load, and torch.compile wall time with and without the backend."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from .common import Row, progress

# Prints "family=seconds ..." and then the total (after `import torch`), so a slow load names its library.
_LOAD_ALL = (
    "import time, torch; t = time.perf_counter(); from tk_inductor import build; parts = []\n"
    "for f in build.families():\n"
    "    s = time.perf_counter(); build.load(f); parts.append(f'{f}={time.perf_counter() - s:.3f}')\n"
    "print(' '.join(parts)); print(time.perf_counter() - t)"
)


def _timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, proc


def compile_seconds(backend: str | None, quick: bool) -> float:
    """Wall time of the first forward+backward of the Llama-style model (compilation dominates)."""
    import torch

    from .e2e import MODELS

    torch._dynamo.reset()
    factory, (batch, seq) = MODELS["llama-sdpa"]
    model = factory(quick).to("cuda", torch.bfloat16)
    compiled = torch.compile(model) if backend is None else torch.compile(model, backend=backend)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")
    start = time.perf_counter()
    compiled(ids).logits.float().mean().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _compile_in_fresh_process(backend: str | None, quick: bool) -> tuple[float | None, str]:
    """compile_seconds in a new process with an empty Inductor cache, so neither side profits from the other's
    warm caches (the kernels themselves stay built: that cost is the cold-build row)."""
    with tempfile.TemporaryDirectory() as inductor_cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache, TRITON_CACHE_DIR=inductor_cache + "/triton")
        code = (f"from benchmarks.buildtime import compile_seconds; "
                f"print(compile_seconds({backend!r}, {quick!r}))")
        _, proc = _timed([sys.executable, "-c", code], env)
    if proc.returncode != 0:
        return None, f"failed: {proc.stderr[-300:]}"
    return float(proc.stdout.strip().splitlines()[-1]), ""


def run(quick: bool = False) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TK_INDUCTOR_CACHE_DIR=cache)
        progress("cold build of all kernels")
        seconds, proc = _timed([sys.executable, "-m", "tk_inductor", "build"], env)
        ok = proc.returncode == 0
        rows.append(Row("build", "cold build, all families", "ours", seconds * 1e3, seconds, "s",
                        note="" if ok else f"failed: {proc.stderr[-300:]}"))
        if ok:
            progress("cached load")
            _, proc = _timed([sys.executable, "-c", _LOAD_ALL], env)
            out = proc.stdout.strip().splitlines()
            load = float(out[-1]) if proc.returncode == 0 else None
            rows.append(Row("build", "cached load, all families", "ours", None if load is None else load * 1e3,
                            load, "s", note=f"seconds per library: {out[-2]}" if load is not None else proc.stderr[-300:]))
            progress(f"  {load} s; {out[-2] if load is not None else proc.stderr[-300:]}")
    for backend, impl in ((None, "torch.compile"), ("thunderkittens", "thunderkittens")):
        progress(f"compile time [{impl}]")
        s, note = _compile_in_fresh_process(backend, quick)
        rows.append(Row("build", "llama-sdpa compile (first fwd+bwd, empty Inductor cache)", impl,
                        None if s is None else s * 1e3, s, "s", note=note))
        progress(f"  {s} s {note}")
    return rows
