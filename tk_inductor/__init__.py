"""tk_inductor: a torch.compile backend that swaps hot subgraphs for fused tile-library kernels.

Importing is cheap: heavy modules load on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["config", "report", "last_report", "reset", "thunderkittens"]


def __getattr__(name):
    if name == "config":
        from . import config

        return config
    if name in ("report", "last_report", "reset"):
        from . import rewrite

        return getattr(rewrite, name)
    if name == "thunderkittens":
        from .backend import thunderkittens

        return thunderkittens
    raise AttributeError(f"module 'tk_inductor' has no attribute {name!r}")
