"""CUDA-event timing shared by the demo and the benchmarks."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms_events(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median over `iters` event-timed calls, for long calls (whole models) where do_bench's budget is too small."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
