"""Train a Llama-style model compiled with the backend under DDP or FSDP2, one process per GPU.

    torchrun --nproc-per-node 2 -m benchmarks.distributed --engine ddp
    torchrun --nproc-per-node 2 -m benchmarks.distributed --engine fsdp2
    python -m benchmarks.distributed --engine single --global-batch 4   # the single-GPU reference

Prints per-step losses (rank 0), tokens/s per GPU for backend="thunderkittens"
and for torch.compile default under the same engine, the report's replaced
families and the number of recompilations, as one JSON line at the end.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device README asks.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from .common import multicast_off

multicast_off()


def vocab(cpu: bool) -> int:
    return 128 if cpu else 32000


def build_model(layers: int, cpu: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2) if cpu else \
        dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8)
    cfg = LlamaConfig(**size, num_hidden_layers=layers, vocab_size=vocab(cpu), attn_implementation="sdpa")
    torch.manual_seed(0)  # same weights on every rank and in the single-GPU reference
    model = LlamaForCausalLM(cfg)
    return model if cpu else model.to(torch.bfloat16)


def batches(global_batch: int, seq: int, steps: int, rank: int, world: int, device, vocab_size: int):
    """The same global batches whatever the world size; each rank takes its slice."""
    gen = torch.Generator().manual_seed(1234)
    per_rank = global_batch // world
    for _ in range(steps):
        ids = torch.randint(0, vocab_size, (global_batch, seq), generator=gen)
        yield ids[rank * per_rank:(rank + 1) * per_rank].to(device)


def train(engine: str, backend: str | None, args) -> dict:
    import tk_inductor

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    model = build_model(args.layers, args.cpu).to(device)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # the small CPU model fits one 25 MB bucket; 1 MB buckets (DDP's smallest) split its graph about once per
        # layer, as DDP splits the real model's
        model = DistributedDataParallel(model, device_ids=None if args.cpu else [device.index],
                                        bucket_cap_mb=1 if args.cpu else 25)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        inner = model.model
        for layer in inner.layers:
            fully_shard(layer)
        fully_shard(model)
    torch._dynamo.reset()
    tk_inductor.reset()
    from torch._dynamo.utils import counters

    counters.clear()  # frames_compiled is per run, not summed with an earlier run in this process
    from tk_inductor.ops import attention_masked as attention_op

    attention_op.masked_paths.clear()
    # on the CPU the ops run their PyTorch references (reference mode), which is what the rewrite is checked with
    options = {"reference": True} if args.cpu else None
    compiled = torch.compile(model) if backend is None else torch.compile(model, backend=backend, options=options)
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    tokens = args.global_batch // world * args.seq
    for step, ids in enumerate(batches(args.global_batch, args.seq, args.steps, rank, world, device, vocab(args.cpu))):
        sync()
        start = time.perf_counter()
        loss = _step(compiled, opt, ids)
        sync()
        times.append(time.perf_counter() - start)
        mean_loss = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean_loss)
            mean_loss /= world
        losses.append(float(mean_loss))
    steady = sorted(times[2:]) or times
    if args.profile:  # every rank steps (DDP and FSDP2 synchronise in it); rank 0 prints
        _profile_step(compiled, opt, next(batches(args.global_batch, args.seq, 1, rank, world, device,
                                                   vocab(args.cpu))), f"{engine} {backend or 'inductor'}", rank == 0)

    return {
        "engine": engine, "backend": backend or "inductor", "world": world, "losses": losses,
        "tokens_per_s_per_gpu": tokens / steady[len(steady) // 2],
        "step_ms": [round(t * 1e3, 1) for t in times],
        "replaced": tk_inductor.report().replaced, "kept": tk_inductor.report().kept,
        "frames_compiled": int(counters["stats"]["unique_graphs"]),
        "masked_attention_paths": dict(attention_op.masked_paths),
    }


def _step(compiled, opt, ids) -> torch.Tensor:
    """One training step (next-token loss, backward, AdamW); returns the loss."""
    logits = compiled(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _profile_step(compiled, opt, ids, title: str, show: bool) -> None:
    """Two more steps under the profiler, printed by rank 0. The first traces the CPU too: the table's top rows
    say where one backend spends more device time. The second records only the GPU's activity, so the host runs
    near its normal speed: the step's span against the time some kernel is running, and the longest idle gaps
    with the kernels around them, say where the GPU waits for the host (a sync, or launches falling behind)."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        _step(compiled, opt, ids)
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as gpu_only:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    if not show:
        return
    print(f"--- profile {title}", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=70), flush=True)
    print(_gaps(gpu_only.events(), wall), flush=True)


def _gaps(events, wall: float, top: int = 10) -> str:
    """Busy time (the union of all device activity, every stream) and the longest idle gaps of one step."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return "no device activity recorded"
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = spans[0]
    for s, e, name in spans[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            gaps.append((s - cur_end, cur_name, name))
            cur_start, cur_end = s, e
        elif e > cur_end:
            cur_end = e
        if e >= cur_end:
            cur_name = name
    busy += cur_end - cur_start
    span = spans[-1][1] - spans[0][0]
    lines = [f"GPU-only trace: step {wall * 1e3:.1f} ms wall, device span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms "
             f"({len(gaps)} idle gaps, {sum(g for g, _, _ in gaps) / 1e3:.1f} ms); longest gaps:"]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap:8.1f} us  after {before[:60]}  before {after[:60]}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["ddp", "fsdp2", "single"], default="ddp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--baseline", action="store_true", help="also run torch.compile default under the same engine")
    p.add_argument("--profile", action="store_true", help="profile one extra step per backend (rank 0, GPU only)")
    p.add_argument("--cpu", action="store_true", help="a tiny fp32 model on the CPU over gloo, ops in reference mode "
                                                      "(checks the graph splitting and the rewrite without GPUs)")
    args = p.parse_args(argv)
    if args.engine != "single":
        dist.init_process_group("gloo" if args.cpu else "nccl")
        if not args.cpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # the baseline runs first, so process warm-up (NCCL, allocator) never flatters ours
    results = [train(args.engine, None, args)] if args.baseline else []
    results.insert(0, train(args.engine, "thunderkittens", args))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(results))
    if dist.is_initialized():
        # every rank done before any tears its connections down: a rank that left first could abort the other's
        # gloo threads mid-operation ("terminate called without an active exception", seen once in CI, torch 2.11)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
