"""python -m benchmarks [--ops attention,rotary] [--quick] [--e2e] [--models llama-sdpa,...] [--build]

Runs every op benchmark (each module `benchmarks/<op>.py` exposes
`run(quick: bool) -> list[Row]`), optionally whole models and build/compile
times, prints one table (ours, each baseline, ratio) and writes JSON and PNG
plots under benchmarks/results/.

A full run does not fit one device call: run it in parts (e.g. the ops, then
the models a few at a time), then `python -m benchmarks --merge a/results.json
b/results.json --out DIR` makes one table, JSON and plots of them. Parts must
come from the same kernel sources (the `kernels` hash in their metadata).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from .common import Row, progress, table

OPS = ("attention", "linear_attention", "ssd", "layernorm", "rotary", "gemm")


def _as_rows(items) -> list[Row]:
    return [r if isinstance(r, Row) else Row(**r) for r in items]


def _commit() -> str:
    """$TK_BENCH_COMMIT if set, else HEAD with -dirty when the tree differs from it. A working tree copied to another
    machine can carry a stale .git (the device's does), so pass the commit you shipped there."""
    if os.environ.get("TK_BENCH_COMMIT"):
        return os.environ["TK_BENCH_COMMIT"]
    try:
        return subprocess.check_output(["git", "describe", "--always", "--dirty"], text=True).strip()
    except Exception:
        return "unknown"


def plot(rows: list[Row], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        progress("matplotlib is not installed: no plots")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        if r.x is not None and r.figure is not None:
            groups[r.op].append(r)
    for op, items in groups.items():
        panels: dict[str, dict[tuple[str, str], list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
        for r in items:
            panel, impl, config = _series(r)
            panels[panel][impl, config].append((r.x, r.figure))
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        impls = sorted({r.impl for r in items})
        configs = sorted({_series(r)[2] for r in items})
        for ax, (panel, series) in zip(axes[0], sorted(panels.items())):
            for (impl, config), pts in sorted(series.items()):
                pts.sort()  # colour per configuration, line style per implementation
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{impl} {config}".strip(),
                        color=f"C{configs.index(config) % 10}", linestyle=("-", "--", ":", "-.")[impls.index(impl) % 4])
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length" if op == "attention" else "size")
            ax.set_ylabel(items[0].unit)
            ax.set_title(f"{op} {panel}".strip())
            ax.legend(fontsize=6)
        path = out / f"{op}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    e2e = _e2e_speedups(rows)
    if e2e:
        fig, ax = plt.subplots(figsize=(8, 0.4 * len(e2e) + 1.5))
        cases = list(e2e)
        for i, base in enumerate(("eager", "torch.compile")):
            vals = [e2e[c].get(base, 0.0) for c in cases]
            ax.barh([j + 0.4 * i for j in range(len(cases))], vals, height=0.4, label=f"vs {base}")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks([j + 0.2 for j in range(len(cases))], cases, fontsize=7)
        ax.set_xlabel("thunderkittens speedup (throughput ratio)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / "e2e.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


PHASES = ("fwd", "bwd", "fwd+bwd")


def _series(r: Row) -> tuple[str, str, str]:
    """(panel, implementation, configuration) of a plotted row. The panel is the case's phase (its last word: fwd,
    bwd, fwd+bwd); the configuration is the case without the words that change along x (batch and sequence length
    words, and any word holding the x value, e.g. "65536x1024" at hidden 1024). Implementation names may have
    spaces ("fla parallel_based")."""
    words = r.case.split()
    panel = words.pop() if words and words[-1] in PHASES else ""
    x = str(int(r.x))
    keep = [w for w in words if not re.fullmatch(r"[BN]\d+", w) and x not in re.findall(r"\d+", w)]
    return panel, r.impl, " ".join(keep)


def _e2e_speedups(rows: list[Row]) -> dict[str, dict[str, float]]:
    """case -> {baseline: ours / baseline throughput} for whole-model rows where both ran."""
    by_case: dict[str, dict[str, Row]] = defaultdict(dict)
    for r in rows:
        if r.op == "e2e" and r.ms:
            by_case[r.case][r.impl] = r
    out = {}
    for case, impls in by_case.items():
        ours = impls.get("thunderkittens")
        if ours is not None:
            out[case] = {b: impls[b].ms / ours.ms for b in ("eager", "torch.compile") if b in impls}
    return out


def _kernels() -> str:
    """The hash of every kernel family's sources (tk_inductor.build.kernel_version): what the numbers measured."""
    try:
        from tk_inductor import build

        return build.kernel_version()
    except Exception as exc:  # the harness still reports without the package
        return f"unknown ({type(exc).__name__})"


def merge(paths: list[str], allow_mixed: bool = False) -> tuple[dict, list[Row]]:
    """Rows of several results.json files, in order; a later file's row replaces an earlier one of the same
    (op, case, impl). Refuses files from different kernel sources unless allow_mixed."""
    metas, rows = [], {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        metas.append({**data["meta"], "file": str(path)})
        for r in _as_rows(data["rows"]):
            rows[(r.op, r.case, r.impl)] = r
    kernels = {m.get("kernels") for m in metas}
    if len(kernels) > 1 and not allow_mixed:
        raise SystemExit("benchmarks --merge: the parts measured different kernel sources "
                         + ", ".join(f"{m['file']}: {m.get('kernels')}" for m in metas) + " (--allow-mixed to merge anyway)")
    meta = {k: metas[-1].get(k) for k in ("date", "commit", "torch", "gpu", "kernels")}
    meta["parts"] = metas
    return meta, list(rows.values())


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated op benchmarks (default: all; 'none' for only --e2e/--build)")
    p.add_argument("--quick", action="store_true", help="a small subset of cases")
    p.add_argument("--e2e", action="store_true", help="also whole models (eager / torch.compile / thunderkittens)")
    p.add_argument("--models", default=None, help="comma-separated e2e models (default: all)")
    p.add_argument("--modes", default=None, help="comma-separated e2e modes: eager,torch.compile,thunderkittens, and mamba_ssm for mamba2 (HF's fast path; default: all)")
    p.add_argument("--precisions", default=None,
                   help="comma-separated e2e training recipes: bf16 (bf16 parameters), amp-bf16, amp-fp16 (fp32 parameters "
                        "under autocast; fp16 with a GradScaler) (default: bf16)")
    p.add_argument("--e2e-timeout", type=float, default=1200.0,
                   help="seconds per (model, mode), each in its own process, compilation included (default 1200)")
    p.add_argument("--build", action="store_true", help="also cold build, cached load and compile times")
    p.add_argument("--out", default=os.environ.get("TK_BENCH_OUT", "benchmarks/results"))
    p.add_argument("--merge", nargs="+", metavar="RESULTS_JSON", help="run nothing: merge these runs' results.json")
    p.add_argument("--allow-mixed", action="store_true", help="--merge parts measured on different kernel sources")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        meta, rows = merge(args.merge, args.allow_mixed)
        return _report(meta, rows, out)
    import torch

    if not cuda_visible():
        print("python -m benchmarks: no CUDA device visible; the benchmarks time GPU kernels (an sm_90 GPU: H100/H200). "
              "--merge works without one.", file=sys.stderr)
        return 2
    meta = {
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "kernels": _kernels(),
    }
    rows: list[Row] = []

    def save(new: list[Row]) -> None:
        """results.json after every part, marked partial until the end: a run that a time limit cuts off keeps what
        finished (and --merge takes it)."""
        rows.extend(new)
        _write({**meta, "partial": True}, rows, out)

    for op in [o for o in args.ops.split(",") if o and o != "none"]:
        try:
            module = importlib.import_module(f"benchmarks.{op}")
        except ModuleNotFoundError as exc:
            save([Row(op, "-", "ours", None, note=f"no benchmark module ({exc})")])
            continue
        progress(f"{op}: starting")
        save(_as_rows(module.run(quick=args.quick)))
    if args.e2e:
        from . import e2e

        e2e.run(quick=args.quick, models=args.models.split(",") if args.models else None,
                modes=args.modes.split(",") if args.modes else None, timeout_s=args.e2e_timeout, on_rows=save,
                precisions=args.precisions.split(",") if args.precisions else None)
    if args.build:
        from . import buildtime

        save(buildtime.run(quick=args.quick))
    return _report(meta, rows, out)


def _write(meta: dict, rows: list[Row], out: Path) -> None:
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))


def _report(meta: dict, rows: list[Row], out: Path) -> int:
    _write(meta, rows, out)
    print(f"# { {k: v for k, v in meta.items() if k != 'parts'} }"
          + (f" merged from {len(meta['parts'])} runs" if "parts" in meta else "")
          + "".join(f" ({m['file']} is partial: its run was cut off)" for m in meta.get("parts", ()) if m.get("partial")))
    print(table(rows))
    for path in plot(rows, out):
        progress(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # `timeout` stops a run with SIGTERM: raised as SystemExit, so the e2e children are killed with it (e2e.py).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
