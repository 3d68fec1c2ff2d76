"""SSD benchmark: ours (tk_cuda::ssd, Mamba-2) vs mamba_ssm's Triton SSD `mamba_chunk_scan_combined` (chunk 256,
what a Mamba user runs; its code travels in the ignored folder .mamba/, see `mamba_ssm_scan`), flash-linear-attention's
Triton `chunk_simple_gla` (carry the fla-core wheel; SSD is simple GLA with q = C, k = B, v = dt·x, log-gate dt·A)
and torch.compile default of the chunked fp32 reference (tk_inductor/ops/ssd.py, the same algorithm as HF Mamba2's
torch path), in one run.

Shapes (DESIGN §5): Mamba-2 2.7B heads (nh 80, p 64, n 128, ng 1) at 65536 tokens, l 1024, 4096 and 16384, plus
Mamba2-370M's (nh 32) at l 4096 and the e2e Mamba2's layer (b1 l4096 nh32), and state size 256 and head dim 32,
which the op runs as parts of what the kernels hold (PARTS_CASES); bf16 x, B, C, fp32 dt, A, D; final
state returned. The forward rows of "ours" note its TFLOPS of chunk math (per head and 64-token chunk, the four
products C·Bᵀ, (L∘C·Bᵀ)·X, C·hᵀ and the state update: 2·64·(64n + 64p + 2np) flops) and its fraction of the floor,
max(bytes / copy bandwidth, flops / bf16 matmul peak), both measured in the same run; bytes are x and y in bf16, B and
C, and dt in fp32.

Forward+backward at 65536 tokens (b16 l4096 and b4 l16384) and at the e2e layer:
- "ours": the op's autograd, the forward and backward kernels;
- "ours (kernel fwd, reference bwd)": the same with the backward kernels off: the reference's autograd as the
  backward.
The torch.compile baseline gets the work-arounds our backend applies to Inductor (split scans off). Figure: Mtokens/s.

    python -m benchmarks.ssd [--quick]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .common import (Row, backward_step, check_and_time, copy_ceiling_gbs, inductor_as_our_backend_runs_it, median_ms,
                     op_main, progress, with_attr)


def cases(quick: bool = False):
    """(b, l, nh, p, n) per case."""
    yield 16, 4096, 80, 64, 128
    if not quick:
        yield 64, 1024, 80, 64, 128
        yield 4, 16384, 80, 64, 128
        yield 16, 4096, 32, 64, 128
        yield 1, 4096, 32, 64, 128  # the e2e Mamba2's layer (1 x 4096 tokens: 16 tasks of two heads)
        yield from PARTS_CASES


# sizes the kernels run in parts (ops/_state_parts.py): state size 256 (two blocks of 128), head dim 32 (padded to 64)
PARTS_CASES = ((8, 4096, 64, 64, 256), (8, 4096, 128, 32, 128))
# forward+backward: 65536 tokens in long and in very long sequences, the e2e layer, the sizes run in parts
TRAIN_CASES = ((16, 4096, 80, 64, 128), (4, 16384, 80, 64, 128), (1, 4096, 32, 64, 128), *PARTS_CASES)


def run(quick: bool = False) -> list[Row]:
    from tk_inductor import build
    from tk_inductor.ops import ssd as ssd_ops

    build.load("ssd")
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as exc:
        chunk_simple_gla, fla_missing = None, f"fla not installed ({exc.name})"
    mamba, mamba_missing = mamba_ssm_scan()
    rows: list[Row] = []
    inductor_as_our_backend_runs_it()
    compiled = torch.compile(ssd_ops.ssd_reference, dynamic=False)
    floor_ms = floor(copy_ceiling_gbs(), matmul_peak_tflops())
    for b, l, nh, p, n in cases(quick):
        name = f"b{b} l{l} nh{nh} p{p} n{n} fwd"
        progress(name)
        x, dt, A, B, C, D = inputs(b, l, nh, p, n)
        ref = ssd_ops.ssd_reference(x, dt, A, B, C, D, None, 64)[0].float()

        # the raw op where the kernels take the sizes whole (no Python op around them), else the op, which runs parts
        op = torch.ops.tk_cuda.ssd if (n, p) not in [(c[4], c[3]) for c in PARTS_CASES] else torch.ops.tk.ssd

        def ours():
            return op(x, dt, A, B, C, D, None, 64)[0]

        impls = {
            "ours": ours,
            # HF Mamba2's chunk (256)
            "torch.compile": lambda: compiled(x, dt, A, B, C, D, None, 256)[0],
        }
        if mamba is not None:
            impls["mamba_ssm"] = lambda: mamba(x, dt, A, B, C, D)
        if chunk_simple_gla is not None:
            impls["fla chunk_simple_gla"] = lambda: fla_ssd(chunk_simple_gla, x, dt, A, B, C, D)
        timed = check_and_time("ssd", name, impls, ref, l, "Mtok/s", lambda ms: b * l / ms / 1e3, tol=2e-2)
        for row in timed:
            if row.impl == "ours" and row.ms:
                flops, least = floor_ms(b, l, nh, p, n)
                row.note = f"{flops / row.ms / 1e9:.0f} TFLOPS, {100 * least / row.ms:.0f}% of the floor ({least:.3f} ms)"
                segments = torch.ops.tk_cuda.ssd_segments(b, l, nh, 1, p)
                if segments > 1:
                    row.note += f", sequences in {segments} segments"
        rows += timed
        if mamba is None:
            rows.append(Row("ssd", name, "mamba_ssm", None, note=mamba_missing))
        if chunk_simple_gla is None:
            rows.append(Row("ssd", name, "fla chunk_simple_gla", None, note=fla_missing))
        del x, B, C, ref
        torch.cuda.empty_cache()
    for b, l, nh, p, n in TRAIN_CASES[:1] if quick else TRAIN_CASES:
        name = f"b{b} l{l} nh{nh} p{p} n{n} fwd+bwd"
        progress(name)
        leaves = [t.requires_grad_() for t in inputs(b, l, nh, p, n)]
        x, dt, A, B, C, D = leaves
        dy = torch.randn_like(x)
        want = [t.detach().float().requires_grad_() for t in leaves]
        ssd_ops.ssd_reference(*want[:6], None, 64)[0].backward(dy.float())

        def ours():
            return torch.ops.tk.ssd(x, dt, A, B, C, D, None, 64)[0]

        impls = {"ours": ours,
                 "torch.compile": lambda: compiled(x, dt, A, B, C, D, None, 256)[0]}
        if mamba is not None:
            impls["mamba_ssm"] = lambda: mamba(x, dt, A, B, C, D)
        if chunk_simple_gla is not None:
            impls["fla chunk_simple_gla"] = lambda: fla_ssd(chunk_simple_gla, x, dt, A, B, C, D)
        steps = {label: backward_step(fn, leaves, dy, of=x) for label, fn in impls.items()}
        # the flag is read when the backward runs: set around the whole step
        steps["ours (kernel fwd, reference bwd)"] = lambda: with_attr(ssd_ops, "BACKWARD_KERNEL_VALIDATED", False,
                                                                      steps["ours"])
        rows += check_and_time("ssd", name, steps, want[0].grad, l, "Mtok/s", lambda ms: b * l / ms / 1e3, tol=2e-2)
        del leaves, x, B, C, want
        torch.cuda.empty_cache()
    return rows


def matmul_peak_tflops(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return 2 * size**3 / median_ms(lambda: a @ a) / 1e9


def floor(copy_gbs: float, peak_tflops: float):
    """(b, l, nh, p, n) -> (chunk-math flops, the floor in ms) for one group (docstring)."""
    def at(b, l, nh, p, n):
        chunks = (l + 63) // 64
        flops = 2 * 64 * (64 * n + 64 * p + 2 * n * p) * b * nh * chunks
        nbytes = 2 * 2 * b * l * nh * p + 2 * 2 * b * l * n + 4 * b * l * nh
        return flops, max(nbytes / copy_gbs / 1e6, flops / peak_tflops / 1e9)
    return at


def inputs(b, l, nh, p, n):
    """x, dt, A, B, C, D: bf16 x, B, C (one group) and fp32 dt, A, D, as HF Mamba2 hands them over in bf16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, l, nh, p, generator=g, device="cuda").to(torch.bfloat16)
    dt = torch.nn.functional.softplus(torch.randn(b, l, nh, generator=g, device="cuda") - 1.0)
    A = -torch.rand(nh, generator=g, device="cuda") * 2 - 0.05
    B = (torch.randn(b, l, 1, n, generator=g, device="cuda") / n**0.5).to(torch.bfloat16)
    C = torch.randn(b, l, 1, n, generator=g, device="cuda").to(torch.bfloat16)
    D = torch.randn(nh, generator=g, device="cuda")
    return x, dt, A, B, C, D


def mamba_ssm_scan():
    """(fn, None), fn(x, dt, A, B, C, D) -> y running mamba_ssm's `mamba_chunk_scan_combined` (chunk 256, the final
    state returned as ours returns it), or (None, why not). mamba_ssm's package needs a CUDA build; its Triton SSD needs
    only torch, triton and einops, so its `mamba_ssm/ops/triton` and `mamba_ssm/utils` are copied (never committed)
    into .mamba/ beside empty `mamba_ssm/__init__.py` and `mamba_ssm/ops/__init__.py`, and carried to the device
    with einops' wheel in .whl/."""
    folder = Path(__file__).resolve().parent.parent / ".mamba"
    if folder.is_dir() and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as exc:
        return None, f"missing: mamba_ssm's Triton SSD not importable ({exc.name}; see benchmarks/ssd.py mamba_ssm_scan)"

    def run(x, dt, A, B, C, D):
        y, _ = mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, return_final_states=True)
        return y

    return run, None


def fla_ssd(chunk_simple_gla, x, dt, A, B, C, D):
    """SSD as FLA's simple GLA: q = C, k = B (one group: every head reads it), v = dt·x, log-gate dt·A."""
    b, l, nh, _ = x.shape
    Bh, Ch = (t.expand(b, l, nh, t.shape[-1]) for t in (B, C))
    v = (x.float() * dt.unsqueeze(-1)).to(torch.bfloat16)
    o, _ = chunk_simple_gla(Ch, Bh, v, g=dt * A, scale=1.0, output_final_state=True)
    return o + D[:, None] * x


def main(argv=None) -> int:
    return op_main("python -m benchmarks.ssd", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
