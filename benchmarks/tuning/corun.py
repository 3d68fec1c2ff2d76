"""Kernels beside NCCL: each op timed alone and while all-reduces run on another stream, as under DDP and FSDP2.

    torchrun --nproc-per-node 2 -m benchmarks.tuning.corun

A persistent grid gives each block a fixed share of the work, sized to the SMs. NCCL's kernels hold some SMs while
they run, so the blocks that do not fit wait and then run their whole share: the kernel can take up to twice as long.
This measures that slowdown for our persistent kernels (attention forward, layernorm backward) next to kernels that
are not persistent (layernorm forward, cuDNN attention, cuBLAS), at the per-GPU
shapes of benchmarks.distributed (Llama, 2 x 2048 tokens, hidden 2048, 16 query heads of 128, 8 KV heads).
Both ranks run the same sequence of collectives; rank 0 prints the table.
"""
from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..common import multicast_off

multicast_off()

def _ops(device):
    import tk_inductor.ops.attention  # noqa: F401  (each module registers its torch.ops.tk ops)
    import tk_inductor.ops.layernorm  # noqa: F401

    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)

    B, N, Hq, Hkv, D, hidden = 2, 2048, 16, 8, 128, 2048
    q, k, v = rand(B, Hq, N, D), rand(B, Hkv, N, D), rand(B, Hkv, N, D)
    kr, vr = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    x, res, w = rand(B * N, hidden), rand(B * N, hidden), rand(hidden)
    y, h, mean, rstd, rng = torch.ops.tk.layernorm(x, res, w, None, None, 1e-6, 0.0, True)
    dy = rand(B * N, hidden)
    a, b = rand(B * N, hidden), rand(hidden, 5632)
    scale = D ** -0.5

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=scale)

    return {
        "attention fwd (ours, persistent)": lambda: torch.ops.tk.attention(q, k, v, True, scale),
        "layernorm bwd (ours, persistent)": lambda: torch.ops.tk.layernorm_backward(dy, None, h, w, mean, rstd, rng,
                                                                                    0.0, True, False),
        "layernorm fwd (ours, one row per block)": lambda: torch.ops.tk.layernorm(x, res, w, None, None, 1e-6, 0.0,
                                                                                  True),
        "attention fwd (cuDNN SDPA)": cudnn,
        "matmul 4096x2048x5632 (cuBLAS)": lambda: a @ b,
    }


def _time(fn, comm: torch.Tensor | None, stream: torch.cuda.Stream, iters: int = 40, reps: int = 3) -> float:
    """GPU time of one call of `fn` (µs): median over `reps` of `iters` back-to-back calls between two events, queued
    behind a sleeping kernel so that the launches never starve the GPU. With `comm`, all-reduces of it run on
    `stream` the whole time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    works = []
    if comm is not None:  # enqueued first, long enough (~50 ms) to cover every timed call below
        with torch.cuda.stream(stream):
            works = [dist.all_reduce(comm, async_op=True) for _ in range(120)]
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)  # ~10 ms: the CPU queues all the calls meanwhile
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        times.append((start, end))
    for work in works:
        work.wait()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times) * 1e3 / iters


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    comm = torch.randn(64 * 2**20, device=device, dtype=torch.bfloat16)  # 128 MB per all-reduce
    stream = torch.cuda.Stream()
    rows = []
    for name, fn in _ops(device).items():
        rows.append((name, _time(fn, None, stream), _time(fn, comm, stream)))
    if rank == 0:
        print("| op | alone µs | beside all-reduce µs | slowdown |")
        print("|---|---|---|---|")
        for name, alone, beside in rows:
            print(f"| {name} | {alone:.1f} | {beside:.1f} | {beside / alone:.2f}× |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
