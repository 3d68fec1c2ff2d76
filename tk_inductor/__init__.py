"""tk_inductor: a torch.compile backend that swaps hot subgraphs for fused tile-library kernels.

    fast = torch.compile(model, backend="thunderkittens")
    tk_inductor.report()        # what was replaced / kept since tk_inductor.reset()

Importing is cheap: torch and the heavy modules load on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = ["config", "report", "last_report", "reset", "thunderkittens"]


def __getattr__(name):
    # importlib, not `from . import x`: the latter asks this very hook for the
    # attribute first and would recurse.
    if name == "config":
        return importlib.import_module(f"{__name__}.config")
    if name in ("report", "last_report", "reset"):
        return getattr(importlib.import_module(f"{__name__}.rewrite"), name)
    if name == "thunderkittens":
        return importlib.import_module(f"{__name__}.backend").thunderkittens
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
