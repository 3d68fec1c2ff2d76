"""A model of the attention forward's task schedule (no GPU): how far the slowest block runs past the mean.

    python -m benchmarks.schedule_model

The forward's persistent grid gives block b the tasks b, b + grid, ... in `decode_task`'s order (forward.cu: heads
in L2 sections of about 2 x SMs tasks, query blocks heaviest-first under causal). A task costs its K/V tiles plus
about one tile for its Q load and epilogue. The table gives each schedule's makespan over the ideal (total / SMs):
static with 1 or 2 waves (TK_GRID_WAVES; the hardware hands later blocks to the SMs that free up first), and a
dynamic schedule where a free block takes the next task (an atomic counter: TK_ATTN_FWD_SCHEDULE=dynamic). A model:
on the H200 at B2 H16 N2048 D128 causal it predicts 1 -> 2 waves 1.35x faster, and 1.27x was measured
(benchmarks/RESULTS.md, "Kernels beside NCCL").
"""
from __future__ import annotations

import heapq

SMS = 132
CASES = {  # name: (B, H, N, BM, BN, causal); BM/BN of the default variants (forward.cu FwdVariants)
    "B2 H16 N2048 D128 causal (measured)": (2, 16, 2048, 128, 128, True),
    "B2 H16 N4096 D128 causal (e2e Llama)": (2, 16, 4096, 128, 128, True),
    "B64 H16 N1024 D128 causal": (64, 16, 1024, 128, 128, True),
    "B32 H16 N2048 D128 causal": (32, 16, 2048, 128, 128, True),
    "B8 H16 N8192 D128 causal": (8, 16, 8192, 128, 128, True),
    "B32 H16 N2048 D128 full": (32, 16, 2048, 128, 128, False),
    "B64 H32 N1024 D64 causal": (64, 32, 1024, 128, 192, True),
    "B32 H32 N2048 D64 causal": (32, 32, 2048, 128, 192, True),
    "B8 H32 N8192 D64 causal": (8, 32, 8192, 128, 192, True),
    "B32 H32 N2048 D64 full": (32, 32, 2048, 192, 128, False),
}


def decode_task(t: int, bh_total: int, nq: int, section: int, causal: bool) -> tuple[int, int]:
    """forward.cu's decode_task: task -> (batch*head, query block)."""
    per_section = section * nq
    sec, r = divmod(t, per_section)
    heads = min(section, bh_total - sec * section)
    rank = r // heads
    return sec * section + (r - rank * heads), (nq - 1 - rank if causal else rank)


def task_costs(B: int, H: int, N: int, BM: int, BN: int, causal: bool, sms: int = SMS) -> list[float]:
    nq, bh_total = (N + BM - 1) // BM, B * H
    section = max(1, min(bh_total, (2 * sms + nq - 1) // nq))  # as launch_fwd
    costs = []
    for t in range(bh_total * nq):
        _, qb = decode_task(t, bh_total, nq, section, causal)
        kv_end = min(N, (qb + 1) * BM) if causal else N
        costs.append((kv_end + BN - 1) // BN + 1.0)
    return costs


def _list_schedule(jobs: list[float], sms: int, start: float = 0.0) -> float:
    """Makespan of running the jobs in order, each on the SM that frees first (the hardware's block dispatch, or a
    counter of tasks)."""
    free = [start] * sms
    end = 0.0
    for job in jobs:
        done = heapq.heappop(free) + job
        end = max(end, done)
        heapq.heappush(free, done)
    return end


def static_makespan(costs: list[float], waves: int, sms: int = SMS, startup: float = 0.5) -> float:
    grid = min(len(costs), sms * waves)
    return _list_schedule([sum(costs[b::grid]) + startup for b in range(grid)], sms)


def dynamic_makespan(costs: list[float], sms: int = SMS, startup: float = 0.5) -> float:
    return _list_schedule(costs, sms, start=startup)


def main() -> None:
    print("| case | tasks | static, 1 wave | static, 2 waves | dynamic |")
    print("|---|---|---|---|---|")
    for name, case in CASES.items():
        costs = task_costs(*case)
        ideal = sum(costs) / SMS
        cells = [static_makespan(costs, 1), static_makespan(costs, 2), dynamic_makespan(costs)]
        print(f"| {name} | {len(costs)} | " + " | ".join(f"{c / ideal:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
