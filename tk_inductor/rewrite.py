"""Run the pattern families over a Dynamo (torch-IR) graph: match -> check -> replace.

Each family lives in `tk_inductor.patterns.<family>` and exposes

    def find(graph: torch.fx.Graph) -> Iterable[Match]

returning every occurrence of its computation. A matcher fills `Match.reason`
itself when the computation is recognised but cannot be proven equal to the
op (padding mask, dropout p>0, unsupported dtype/head dim ...). This module
adds the checks shared by all families (allowlist, device, kernel built,
training without a backward kernel), replaces what passes, and records
everything in the report.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import operator
from collections import Counter
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from . import build
from .config import FAMILIES, Config

log = logging.getLogger("tk_inductor")


@dataclasses.dataclass
class Match:
    family: str
    outputs: list[fx.Node]  # nodes whose uses take the op's outputs, in the op's output order
    target: Callable | None = None  # e.g. torch.ops.tk.rotary.default
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    reason: str | None = None  # recognised but kept, and why
    needs_grad: bool = False  # set by the matcher when any differentiable input requires grad
    has_backward_kernel: bool = True  # False: only replace in graphs that need no gradient
    device: torch.device | None = None  # device of the inputs (from example values)


# ---------------------------------------------------------------------------- helpers for matchers

def example(node: Any):
    """The example value Dynamo recorded for a node (a FakeTensor, a python scalar, ...)."""
    if isinstance(node, fx.Node):
        meta = node.meta
        return meta.get("example_value", meta.get("val"))
    return node


# ---------------------------------------------------------------------------- the report

@dataclasses.dataclass
class GraphReport:
    replaced: Counter = dataclasses.field(default_factory=Counter)
    kept: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        rep = ", ".join(f"{f}×{n}" for f, n in sorted(self.replaced.items())) or "nothing"
        kept = "; ".join(f"{f}: {r}" for f, r in self.kept)
        return f"tk_inductor: replaced {rep}" + (f"; kept {kept}" if kept else "")


@dataclasses.dataclass
class Report:
    """Everything compiled since the last `tk_inductor.reset()`."""

    graphs: list[GraphReport] = dataclasses.field(default_factory=list)

    @property
    def replaced(self) -> dict[str, int]:
        total: Counter = Counter()
        for g in self.graphs:
            total.update(g.replaced)
        return dict(total)

    @property
    def kept(self) -> list[tuple[str, str]]:
        return [k for g in self.graphs for k in g.kept]

    def __str__(self) -> str:
        return "\n".join(g.summary() for g in self.graphs) or "tk_inductor: no graphs compiled"


_report = Report()


def report() -> Report:
    return _report


def last_report() -> GraphReport | None:
    return _report.graphs[-1] if _report.graphs else None


def reset() -> None:
    _report.graphs.clear()


# ---------------------------------------------------------------------------- the pass

def _shared_reason(m: Match, cfg: Config) -> str | None:
    if m.family not in cfg.ops:
        return "not in the ops allowlist"
    if m.needs_grad and not m.has_backward_kernel and not cfg.reference:
        return "training, and the op has no backward kernel yet"
    if cfg.reference:
        return None
    if m.device is None or m.device.type != "cuda":
        return f"device {m.device} (kernels are CUDA-only; reference mode runs anywhere)"
    if torch.cuda.get_device_capability(m.device) != (9, 0):
        return f"GPU capability {torch.cuda.get_device_capability(m.device)} (kernels need sm_90)"
    if not build.try_load(m.family):
        return f"kernel not built ({(build.failure(m.family) or 'no sources').splitlines()[0][:200]})"
    return None


def _replace(graph: fx.Graph, m: Match) -> None:
    # Insert after the last output so every input is defined; users that came
    # earlier are fixed by the topological re-sort at the end of the pass.
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(m.outputs, key=order.__getitem__)
    with graph.inserting_after(last):
        call = graph.call_function(m.target, m.args, m.kwargs)
    if len(m.outputs) == 1 and not _returns_tuple(m.target):
        m.outputs[0].replace_all_uses_with(call)
        return
    anchor = call
    for i, out in enumerate(m.outputs):
        if out is None:
            continue
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, i))
        out.replace_all_uses_with(item)
        anchor = item


def _returns_tuple(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and len(schema.returns) > 1


def run(gm: fx.GraphModule, cfg: Config) -> GraphReport:
    """Rewrite `gm` in place for every family; returns (and records) its report."""
    from torch.fx.passes.tools_common import legalize_graph

    graph_report = GraphReport()
    for family in FAMILIES:
        module = importlib.import_module(f"tk_inductor.patterns.{family}")
        for m in list(module.find(gm.graph)):
            reason = m.reason or _shared_reason(m, cfg)
            if reason is not None:
                graph_report.kept.append((family, reason))
                continue
            _replace(gm.graph, m)
            graph_report.replaced[family] += 1
        if graph_report.replaced.get(family):
            legalize_graph(gm)
            gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    _report.graphs.append(graph_report)
    log.info("%s", graph_report.summary())
    if cfg.verbose:
        print(graph_report.summary(), flush=True)
    return graph_report
