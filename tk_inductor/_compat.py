"""Work-arounds for bugs in the torch versions we support (2.11 through 2.14), applied by the backend before it calls
Inductor. Each one checks for the bug itself, so it does nothing on versions that have the fix."""
from __future__ import annotations

import functools
import inspect
import re


def patch_cantsplit(simd=None) -> bool:
    """torch 2.11's SIMD tiling (`SIMDKernel._split_iteration_ranges`, the bmm-then-pointwise three-way split)
    raises a bare `CantSplit`, whose __init__ requires two arguments. The exception that should make Inductor
    try another split turns into a TypeError that fails the whole compile (Based-style models' linear attention,
    `CantSplit.__init__() missing 2 required positional arguments`). Give the arguments defaults; later torch
    passes them. Returns whether the patch was applied by this call."""
    if simd is None:
        try:
            from torch._inductor.codegen import simd
        except Exception:  # noqa: BLE001  (no Inductor: nothing to patch)
            return False
    cls = getattr(simd, "CantSplit", None)
    kernel = getattr(simd, "SIMDKernel", None)
    if cls is None or kernel is None or getattr(cls, "_tk_defaults", False):
        return False
    try:
        source = inspect.getsource(kernel._split_iteration_ranges)
    except (OSError, TypeError, AttributeError):
        return False
    if not re.search(r"raise CantSplit\s*$", source, re.MULTILINE):
        return False
    init = cls.__init__

    def __init__(self, expr=None, remaining=None):
        init(self, expr, remaining)

    cls.__init__ = __init__
    cls._tk_defaults = True
    return True


_SCANS = frozenset({"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"})


def graph_has_scan(gm) -> bool:
    """Whether the (Dynamo) graph calls a scan: the ops Inductor may lower to a split scan."""
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in _SCANS:
            return True
        if node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _SCANS:
            return True
    return False


def disable_split_scans(ir=None) -> bool:
    """Inductor splits a scan over a strided axis with few rows across blocks (TritonSplitScanKernel), and that
    code generation fails in torch 2.11 and 2.14 ("Unexpected tiling"; on HF Mamba2's `cumsum(A.permute(...))`,
    "list indices must be integers or slices, not NoneType"), failing the whole graph. Make every scan one block
    per row. The backend calls this before compiling a graph with a scan, and it stays on for the process:
    AOTAutograd compiles the backward graph later, outside the backend. It costs speed only on long scans of few
    rows. tests/backend/fake_cuda_inductor.py shows the failure and the fix without a GPU. Returns whether this call
    turned it on."""
    if ir is None:
        try:
            from torch._inductor import ir
        except Exception:  # noqa: BLE001  (no Inductor: nothing to patch)
            return False
    scan = getattr(ir, "Scan", None)
    hint = getattr(getattr(ir, "ReductionHint", None), "DEFAULT", None)
    if scan is None or hint is None or getattr(scan, "_tk_no_split", False) or not hasattr(scan, "num_splits"):
        return False

    def num_splits(cls, *args, **kwargs):
        return hint, 1

    scan.num_splits = classmethod(num_splits)
    scan._tk_no_split = True
    return True


@functools.cache
def apply() -> None:
    """Once per process (the checks read torch's sources): called before every Inductor compile."""
    patch_cantsplit()
