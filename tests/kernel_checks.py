"""Shared by the GPU tests: dtypes, their norm-wise tolerances, the NaN poisoning, and a record of raw kernel calls.

Outputs are poisoned before each kernel call: NaN-filled blocks of the outputs' sizes are freed into the caching
allocator right before the op allocates, so elements a kernel fails to write show up as NaN (and rel_err rejects
NaN)."""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def poison(*like: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Leave NaN-filled free blocks of these sizes in the caching allocator."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in like]
    del blocks


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in kernel output (unwritten or invalid)"
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def record_raw_calls(monkeypatch) -> list[str]:
    """The names of the raw `tk_cuda::` ops the `tk::` ops call from now on (a test's proof that the kernels ran,
    not the reference a `tk::` op falls back to)."""
    from tk_inductor.ops import _dispatch

    calls, kernel = [], _dispatch.kernel

    def recording(name):
        op = kernel(name)

        def call(*args, **kwargs):
            calls.append(name)
            return op(*args, **kwargs)
        return call
    monkeypatch.setattr(_dispatch, "kernel", recording)
    return calls
