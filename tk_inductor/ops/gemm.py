"""`tk::gemm`: bf16 matrix product on the tile library's LCSF template (benchmarks only).

    tk::gemm(a, b) -> c      a (M, K) @ b (K, N), bfloat16 in and out, fp32 accumulation; M, N, K >= 1.

It proves the tile library (persistent grid, TMA ring, wgmma) against cuBLAS and is never swapped into
graphs. The CUDA kernel (csrc/kernels/gemm, `tk_cuda::gemm`) runs for CUDA bf16 inputs when the kernels
build; everything else (CPU, other float dtypes, reference mode) runs the reference `torch.matmul`.
`configured(a, b, stages, tma_store, overlap)` runs one kernel configuration, for the ablation.
"""
from __future__ import annotations

import torch

from . import _dispatch

FAMILY = "gemm"


def _validate(a, b, op: str = "tk::gemm") -> None:
    check = _dispatch.check
    _dispatch.check_operands(op, "rows, cols", a=a, b=b)
    check(a.shape[1] == b.shape[0], lambda: f"{op}: inner dims differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    check(min(a.shape[0], a.shape[1], b.shape[1]) >= 1,
          lambda: f"{op}: M, N, K must be >= 1, got {tuple(a.shape)} @ {tuple(b.shape)}")


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def _use_kernel(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == torch.bfloat16 and _dispatch.use_kernel(FAMILY, a, b)


@torch.library.custom_op("tk::gemm", mutates_args=())
def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _validate(a, b)
    if _use_kernel(a, b):
        return _dispatch.kernel("gemm")(a, b)
    return reference(a, b)


@gemm.register_fake
def _(a, b):
    _validate(a, b)
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = gemm(grad, b.t().contiguous()) if ctx.needs_input_grad[0] else None
    grad_b = gemm(a.t().contiguous(), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


gemm.register_autograd(_backward, setup_context=_setup_context)


# Valid kernel configurations (stages, tma_store, overlap): the TMA-store epilogue leaves room for 3 stages,
# overlap needs 2. The kernel's default is (3, True, False).
CONFIGS = [(n, t, o) for t in (False, True) for o in (False, True) for n in (1, 2, 3, 4)
           if not (t and n == 4) and not (o and n == 1)]


def configured(a: torch.Tensor, b: torch.Tensor, stages: int, tma_store: bool, overlap: bool) -> torch.Tensor:
    """The CUDA kernel in a given configuration (see CONFIGS): the ablation. Needs CUDA bf16 inputs and built kernels."""
    _validate(a, b, "tk::gemm configured")
    _dispatch.check((stages, bool(tma_store), bool(overlap)) in CONFIGS,
                    lambda: f"tk::gemm configured: (stages, tma_store, overlap) must be one of {CONFIGS}")
    _dispatch.check(a.dtype == torch.bfloat16 and a.is_cuda, "tk::gemm configured: needs CUDA bfloat16 inputs")
    _dispatch.check(_dispatch.use_kernel(FAMILY, a, b),
                    lambda: f"tk::gemm configured: kernels unavailable: {_failure()}", RuntimeError)
    return torch.ops.tk_cuda.gemm_config(a, b, stages, bool(tma_store), bool(overlap))


def _failure() -> str:
    from .. import build

    return build.failure(FAMILY) or "reference mode is on"
