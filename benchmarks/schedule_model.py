"""A model of the attention forward's task schedule (no GPU): how far the slowest block runs past the mean.

    python -m benchmarks.schedule_model

The forward's persistent grid gives block b the tasks b, b + grid, ... in `decode_task`'s order (forward.cu: heads
in L2 sections of about 2 x SMs tasks, query blocks heaviest-first under causal). A task costs its K/V tiles plus
about one tile for its Q load and epilogue. The table gives each schedule's makespan over the ideal (total / SMs):
static with 1 or 2 waves (TK_GRID_WAVES; the hardware hands later blocks to the SMs that free up first), and a
dynamic schedule where a free block takes the next task (an atomic counter: TK_ATTN_FWD_SCHEDULE=dynamic). A model:
on the H200 at B2 H16 N2048 D128 causal it predicts 1 -> 2 waves 1.35x faster, and 1.27x was measured
(benchmarks/RESULTS.md, "Kernels beside NCCL").

    python -m benchmarks.schedule_model --backward

The backward launches one block per (kv head, key block of 128), which the hardware dispatches in block order to
the SMs that free up first. A block costs one step per (query tile of 64, query head of its GQA group) from its
diagonal on (causal) plus about two for K/V and the dK/dV epilogue. Compared: the order head by head
(TK_ATTN_BWD_ORDER=heads) and L2 sections of heads with key blocks outermost (=sections; backward.cu bwd_section).
"""
from __future__ import annotations

import argparse
import heapq
import math

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
    "B2 H16 N2048 D128 full (4096 tokens)": (2, 16, 2048, 128, 128, False),
    "B2 H32 N2048 D64 full (4096 tokens)": (2, 32, 2048, 192, 128, False),
    "B2 H32 N2048 D64 full (4096 tokens), 128-row tiles (v2)": (2, 32, 2048, 128, 128, False),
}


def section_decode(t: int, heads_total: int, ranks: int, section: int) -> tuple[int, int]:
    """common.cuh's section_decode: task -> (head, rank of its block)."""
    sec, r = divmod(t, section * ranks)
    heads = min(section, heads_total - sec * section)
    rank = r // heads
    return sec * section + (r - rank * heads), rank


def decode_task(t: int, bh_total: int, nq: int, section: int, causal: bool) -> tuple[int, int]:
    """forward.cu's decode_task: task -> (batch*head, query block)."""
    bh, rank = section_decode(t, bh_total, nq, section)
    return bh, (nq - 1 - rank if causal else rank)


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


BWD_BN, BWD_BM = 128, 64
BWD_CASES = {  # name: (B, Hkv, group, N, D, causal)
    "B2 H16 N2048 D128 causal (per-GPU training)": (2, 16, 1, 2048, 128, True),
    "B2 Hkv8 x2 N4096 D128 causal (e2e Llama)": (2, 8, 2, 4096, 128, True),
    "B1 Hkv8 x2 N4096 D128 causal": (1, 8, 2, 4096, 128, True),
    "B4 Hkv8 x2 N4096 D128 causal": (4, 8, 2, 4096, 128, True),
    "B2 H32 N2048 D64 causal": (2, 32, 1, 2048, 64, True),
    "B64 H16 N1024 D128 causal": (64, 16, 1, 1024, 128, True),
    "B32 H16 N2048 D128 causal (op sweep)": (32, 16, 1, 2048, 128, True),
    "B8 H16 N8192 D128 causal (op sweep)": (8, 16, 1, 8192, 128, True),
    "B32 H32 N2048 D64 causal (op sweep)": (32, 32, 1, 2048, 64, True),
    "B32 H16 N2048 D128 full (op sweep)": (32, 16, 1, 2048, 128, False),
}


def bwd_section(sections: bool, nk: int, bh: int, group: int, N: int, D: int, sms: int = SMS) -> int:
    """backward.cu's bwd_section: kv heads per section of the block order."""
    if not sections:
        return 1
    return max(1, min(bh, math.ceil(4 * sms / nk), (32 << 20) // max(1, group * N * D * 8)))


def bwd_block_costs(B: int, Hkv: int, group: int, N: int, D: int, causal: bool, sections: bool,
                    sms: int = SMS) -> list[float]:
    """The backward's blocks in launch order, each as its cost."""
    nk, nqb, bh = (N + BWD_BN - 1) // BWD_BN, (N + BWD_BM - 1) // BWD_BM, B * Hkv
    section = bwd_section(sections, nk, bh, group, N, D, sms)
    costs = []
    for t in range(bh * nk):
        _, kb = section_decode(t, bh, nk, section)
        costs.append(group * (nqb - ((kb * BWD_BN) // BWD_BM if causal else 0)) + 2.0)
    return costs


def main_backward() -> None:
    print("| case | blocks | head by head | sections (heads per section) |")
    print("|---|---|---|---|")
    for name, case in BWD_CASES.items():
        B, Hkv, group, N, D, causal = case
        cells = []
        for sections in (False, True):
            costs = bwd_block_costs(*case, sections)
            cells.append(_list_schedule(costs, SMS) / (sum(costs) / SMS))
        section = bwd_section(True, (N + BWD_BN - 1) // BWD_BN, B * Hkv, group, N, D)
        print(f"| {name} | {len(costs)} | {cells[0]:.3f} | {cells[1]:.3f} ({section}) |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.schedule_model", description=__doc__.splitlines()[0])
    ap.add_argument("--backward", action="store_true", help="the backward's block orders instead of the forward")
    if ap.parse_args(argv).backward:
        main_backward()
        return
    print("| case | tasks | static, 1 wave | static, 2 waves | dynamic |")
    print("|---|---|---|---|---|")
    for name, case in CASES.items():
        costs = task_costs(*case)
        ideal = sum(costs) / SMS
        cells = [static_makespan(costs, 1), static_makespan(costs, 2), dynamic_makespan(costs)]
        print(f"| {name} | {len(costs)} | " + " | ".join(f"{c / ideal:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
