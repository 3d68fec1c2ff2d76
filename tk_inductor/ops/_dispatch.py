"""Where a `tk::` op runs: its CUDA kernel, or its PyTorch reference.

Every family's compiled library registers raw ops `tk_cuda::<name>` with the
same schema as the user-facing `tk::<name>`; the `tk::` op calls the raw op
when the inputs are on CUDA, the family's kernels load, and reference mode is
off. Everywhere else it runs the reference, so reference mode works on any
device and CPU tests exercise the whole rewrite.
"""
from __future__ import annotations

import warnings

import torch

from .. import build, config


_warned_unloaded: set[str] = set()


def use_kernel(family: str, *tensors: torch.Tensor | None) -> bool:
    """Whether the family's kernel runs for these operands: all on CUDA, reference mode off, the kernels loaded. A
    family whose kernels do not load (after an Inductor cache hit the rewrite pass, which reports it, never ran) warns
    once with the reason and runs the reference, or raises under `strict`: a GPU user is never silently on the
    slow path."""
    if not all(t is None or t.is_cuda for t in tensors):
        return False
    if config.reference_at_run_time():
        return False
    if build.try_load(family):
        return True
    reason = (build.failure(family) or "not built").strip().splitlines()[0][:300]
    message = (f"tk_inductor: the {family} kernels did not load ({reason}); tk:: {family} ops on CUDA run their "
               "PyTorch reference instead (slow). `python -m tk_inductor doctor` shows why.")
    if config.flag_at_run_time("strict"):
        raise RuntimeError(message)
    if family not in _warned_unloaded:
        _warned_unloaded.add(family)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return False


def kernel(name: str):
    """The raw CUDA op `tk_cuda::<name>` (after `use_kernel` said yes)."""
    return getattr(torch.ops.tk_cuda, name)


# Floating dtypes the references accept; each kernel checks its own, narrower set.
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check(condition: bool, message, error: type[Exception] = ValueError) -> None:
    """Input validation for ops called directly: a clear Python error, never a device crash. `message` is a string
    or, where it formats values, a lambda making it: the checks run on every op call and formatting costs more than
    checking."""
    if not condition:
        raise error(message() if callable(message) else message)


def reference_vjp(forward, inputs, cotangents) -> list:
    """The gradients of forward(*inputs) for `cotangents` (one per output, cast to its dtype), contiguous, None for
    the inputs that are None: torch.func.vjp, not torch.autograd, as a custom op's body runs below the autograd dispatch
    key (and torch.compile traces it whole). The ops' reference backwards."""
    present = [i for i, t in enumerate(inputs) if t is not None]

    def partial(*tensors):
        full = list(inputs)
        for i, t in zip(present, tensors):
            full[i] = t
        return forward(*full)

    out, vjp = torch.func.vjp(partial, *(inputs[i] for i in present))
    if isinstance(out, tuple):
        grads = list(vjp(tuple(c.to(o.dtype) for c, o in zip(cotangents, out))))
    else:
        grads = list(vjp(cotangents[0].to(out.dtype)))
    return [grads.pop(0).contiguous() if t is not None else None for t in inputs]


def check_grad(op: str, name: str, grad, shape, what: str) -> None:
    """A backward op's incoming gradient `name`: a tensor of `shape`, the shape of `what` (for the message)."""
    shape = tuple(shape)
    check(isinstance(grad, torch.Tensor) and tuple(grad.shape) == shape,
          lambda: f"{op}: {name} must have {what} {shape}, got {tuple(getattr(grad, 'shape', ()))}")


def check_flags(op: str, **flags) -> None:
    """The ops' flags are `bool?` in their schemas, so that None reaches them (a `bool` argument turns None into
    False on the way in): None is a TypeError here, never a silent False."""
    for name, value in flags.items():
        check(value is not None, lambda: f"{op}: {name} must be a bool, got None", TypeError)


def broadcasts_to(shape, target) -> bool:
    """Whether `shape` broadcasts to exactly `target`. Plain ints are compared directly: torch.broadcast_shapes
    is symbolic-shape aware and costs ~10 us a call, paid on every op call at run time."""
    shape, target = tuple(shape), tuple(target)
    if all(type(s) is int for s in shape + target):
        return len(shape) <= len(target) and all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))
    try:  # symbolic sizes (fake tensors while tracing): torch's own rules, which guard correctly
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def check_operands(op: str, layout: str, **operands) -> None:
    """The named operands are tensors of one floating dtype on one device, each of rank len(layout.split(', '))."""
    rank = len(layout.split(", "))
    for name, t in operands.items():
        check(isinstance(t, torch.Tensor), lambda: f"{op}: {name} must be a tensor, got {type(t).__name__}", TypeError)
        check(t.dim() == rank, lambda: f"{op}: {name} must be {rank}-D ({layout}), got shape {tuple(t.shape)}")
        check(t.dtype in FLOATS, lambda: f"{op}: {name} dtype {t.dtype} is not a floating type", TypeError)
    names, ts = ", ".join(operands), list(operands.values())
    check(all(t.dtype == ts[0].dtype for t in ts),
          lambda: f"{op}: {names} dtypes differ ({', '.join(str(t.dtype) for t in ts)})", TypeError)
    check(all(t.device == ts[0].device for t in ts),
          lambda: f"{op}: {names} devices differ ({', '.join(str(t.device) for t in ts)})")


def nan_from(feeds: torch.Tensor, reads: torch.Tensor | None, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """What a causal scan's reference adds to its outputs so that a non-finite input reaches only the positions
    causality allows: NaN from the first position whose input enters the running state (`feeds`) on, and at
    positions whose own read (`reads`) is non-finite; 0 elsewhere (positions along `dim`). The reference first
    computes those inputs as zeros: its masked products multiply zero weights with later positions' values, and
    0·NaN would reach earlier outputs. Added, not selected, so the gradients pass through unchanged."""
    hit = feeds.cumsum(dim=dim) > 0
    if reads is not None:
        hit = hit | reads
    return torch.where(hit, torch.tensor(float("nan"), dtype=dtype, device=feeds.device), 0.0)


def has_kernel(name: str) -> bool:
    """Whether a loaded library registered `tk_cuda::<name>` (a family may ship its forward before its backward)."""
    try:
        getattr(torch.ops.tk_cuda, name)
    except (AttributeError, RuntimeError):
        return False
    return True
