"""Command line: `python -m tk_inductor demo | doctor | build` (also installed as `tk-inductor`)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time


def _nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run ({exc})"
    lines = [line for line in out.splitlines() if "release" in line]
    return lines[-1].strip() if lines else (out.strip().splitlines() or ["unknown"])[-1]


def doctor(_args) -> int:
    import torch

    from . import build, config

    def row(name: str, value) -> None:
        print(f"{name:<24}{value}")  # "kernel linear_attention" plus a space

    row("python", f"{platform.python_version()} ({sys.executable})")
    row("torch", f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})")
    sm90 = False
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            sm90 = sm90 or cap == (9, 0)
            note = "" if cap == (9, 0) else "  (kernels need sm_90: subgraphs stay with Inductor)"
            row(f"gpu {i}", f"{torch.cuda.get_device_name(i)}, sm_{cap[0]}{cap[1]}{note}")
        row("cuda runtime", torch.version.cuda)
    else:
        row("gpu", "none visible (kernels are CUDA-only; reference mode runs anywhere)")
    home = build.cuda_home()
    row("CUDA_HOME", home or "not found (set CUDA_HOME to the folder holding bin/nvcc and include/cuda.h)")
    if home:
        nvcc = os.path.join(home, "bin", "nvcc")
        row("nvcc", f"{nvcc}: {_nvcc_version(nvcc)}")
    try:
        cfg = config.current()
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}  # every option, as resolved
        row("config", " ".join(f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in fields.items()))
    except (ValueError, TypeError) as exc:
        row("config", f"INVALID: {exc}")
    from ._autoload import enabled

    row("TK_INDUCTOR", "on: default torch.compile runs the rewrite" if enabled() else "off: only backend='thunderkittens' rewrites")
    from .rewrite import _family_finders

    row("matchers", ", ".join(_family_finders()) or "none")
    row("cache dir", build.cache_dir())
    families = build.families()
    if not families:
        row("kernels", f"no kernel sources under {build.KERNELS}")
    elif not sm90:
        row("kernels", "no build needed: this machine has no sm_90 GPU, so no kernel would run here")
        return 0
    for family in families:
        state = "built" if build.is_built(family) else "not built (run: python -m tk_inductor build)"
        row(f"kernel {family}", f"{state}  [{build.build_dir(family)}]")
    return 0


def build_command(args) -> int:
    from . import build

    available = build.families()
    if args.families:
        wanted = [f for f in (x.strip() for x in args.families.split(",")) if f]
        missing = [f for f in wanted if f not in available]
        if missing:
            print(f"tk_inductor build: no kernel sources for {missing}; families with sources: {available}", file=sys.stderr)
            return 1
    else:
        wanted = available
    if not wanted:
        print(f"tk_inductor build: no kernel sources under {build.KERNELS}")
        return 0
    workers = build.build_workers(len(wanted))
    print(f"building {len(wanted)} kernel famil{'y' if len(wanted) == 1 else 'ies'} into {build.cache_dir()}"
          + (f", {workers} at a time" if workers > 1 else ""), flush=True)
    import torch  # noqa: F401  (imported before the clock starts: a process that builds on first use has it already)

    failed = []
    total = time.time()
    done = 0

    def report(family: str, error: str | None, seconds: float, cached: bool) -> None:
        nonlocal done
        done += 1
        prefix = f"[{done}/{len(wanted)}] {family:<17}"
        if error is not None:
            failed.append(family)
            detail = error if args.verbose else error.strip().splitlines()[0][:300]
            print(f"{prefix}FAILED after {seconds:.1f} s: {detail}", flush=True)
        else:
            print(f"{prefix}ok ({'cached, ' if cached else ''}{seconds:.1f} s)", flush=True)

    build.build_all(wanted, verbose=args.verbose, on_done=report)
    print(f"done in {time.time() - total:.1f} s: {len(wanted) - len(failed)} built, {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demo parses its own options
        from .demo import main as demo

        return demo(argv[1:])
    parser = argparse.ArgumentParser(prog="tk-inductor", description="tk_inductor: torch.compile backend with fused CUDA kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compile a built-in Llama-style model with the backend, check it, time it on a GPU "
                   "(`demo --help` for its options)")
    sub.add_parser("doctor", help="print GPU, CUDA, torch, compiler, cache and which kernels are built").set_defaults(func=doctor)
    b = sub.add_parser("build", help="build the kernels ahead of time")
    b.add_argument("--families", help="comma-separated families (default: every family with sources)")
    b.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands and full errors")
    b.set_defaults(func=build_command)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
