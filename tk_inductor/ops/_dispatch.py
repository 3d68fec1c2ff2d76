"""Where a `tk::` op runs: its CUDA kernel, or its PyTorch reference.

Every family's compiled library registers raw ops `tk_cuda::<name>` with the
same schema as the user-facing `tk::<name>`; the `tk::` op calls the raw op
when the inputs are on CUDA, the family's kernels load, and reference mode is
off. Everywhere else it runs the reference, so reference mode works on any
device and CPU tests exercise the whole rewrite.
"""
from __future__ import annotations

import torch

from .. import build, config


def use_kernel(family: str, *tensors: torch.Tensor | None) -> bool:
    if not all(t is None or t.is_cuda for t in tensors):
        return False
    if config.reference_at_run_time():
        return False
    return build.try_load(family)


def kernel(name: str):
    """The raw CUDA op `tk_cuda::<name>` (after `use_kernel` said yes)."""
    return getattr(torch.ops.tk_cuda, name)


# Floating dtypes the references accept; each kernel checks its own, narrower set.
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check(condition: bool, message: str, error: type[Exception] = ValueError) -> None:
    """Input validation for ops called directly: a clear Python error, never a device crash."""
    if not condition:
        raise error(message)


def check_operands(op: str, layout: str, **operands) -> None:
    """The named operands are tensors of one floating dtype on one device, each of rank len(layout.split(', '))."""
    rank = len(layout.split(", "))
    for name, t in operands.items():
        check(isinstance(t, torch.Tensor), f"{op}: {name} must be a tensor, got {type(t).__name__}", TypeError)
        check(t.dim() == rank, f"{op}: {name} must be {rank}-D ({layout}), got shape {tuple(t.shape)}")
        check(t.dtype in FLOATS, f"{op}: {name} dtype {t.dtype} is not a floating type", TypeError)
    names, ts = ", ".join(operands), list(operands.values())
    check(all(t.dtype == ts[0].dtype for t in ts),
          f"{op}: {names} dtypes differ ({', '.join(str(t.dtype) for t in ts)})", TypeError)
    check(all(t.device == ts[0].device for t in ts),
          f"{op}: {names} devices differ ({', '.join(str(t.device) for t in ts)})")


def has_kernel(name: str) -> bool:
    """Whether a loaded library registered `tk_cuda::<name>` (a family may ship its forward before its backward)."""
    try:
        getattr(torch.ops.tk_cuda, name)
    except (AttributeError, RuntimeError):
        return False
    return True
