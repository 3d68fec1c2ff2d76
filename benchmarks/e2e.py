"""Whole models: eager vs torch.compile default vs backend="thunderkittens".

Forward (inference, no grad) and a full training step (forward, backward,
AdamW step), tokens/s and peak memory, plus torch.compile wall time. Models
are built from configs with random weights (nothing is downloaded).

Each (model, mode) runs in its own process under a time limit: no mode
profits from another's warm Inductor caches, and a compiler that hangs or
crashes (Inductor on the scan-heavy models) is reported for that mode alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from .common import Row, median_ms_events, progress

MODES = ("eager", "torch.compile", "thunderkittens")
# HF Mamba2's own fast path: the eager model with mamba_ssm's kernels (its Triton SSD and fused training path) and
# causal_conv1d importable, as a Mamba user with both installed runs it. Neither is on the device: mamba_ssm's
# `ops/triton` and `utils`, causal_conv1d's Python package and its extension built for the device's torch go in the
# ignored folder .mamba/ (never committed; benchmarks/ssd.py `mamba_ssm_scan`). The other modes run without them, as
# HF's torch path, the one the backend matches (with mamba_ssm importable HF calls its kernels, which the backend
# leaves as they are).
HF_KERNELS = "mamba_ssm"
HF_KERNELS_MODELS = ("mamba2",)
MAMBA_DIR = Path(__file__).resolve().parent.parent / ".mamba"


def _llama(attn: str, quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8,
        num_hidden_layers=4 if quick else 16, vocab_size=32000, max_position_embeddings=8192,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg)


def _mistral(quick: bool):  # the Llama above with Mistral's sliding window, over twice the window
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        num_hidden_layers=4 if quick else 16, vocab_size=32000, max_position_embeddings=8192, sliding_window=2048,
        attn_implementation="sdpa",
    )
    return MistralForCausalLM(cfg)


def _gemma2(quick: bool, hidden=2048, inter=5632, heads=16, kv_heads=8, head_dim=128, window=2048):
    """Gemma-2's scores (softcap 50, a window on alternate layers), eager attention; by default at head dim 128."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, num_hidden_layers=4 if quick else 8, vocab_size=32000, max_position_embeddings=8192,
        sliding_window=window, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=head_dim, attn_implementation="eager",
    )
    return Gemma2ForCausalLM(cfg)


def _gpt2(quick: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=1024, n_layer=4 if quick else 24, n_head=16, n_positions=4096,
                     attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg)


def _based(quick: bool):
    from tk_inductor.models.based import BasedConfig, BasedLM

    return BasedLM(BasedConfig(layers=3 if quick else 12))


def _mamba2(quick: bool):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(hidden_size=1024, num_hidden_layers=4 if quick else 48, state_size=128, head_dim=64,
                       num_heads=32, n_groups=1, expand=2, vocab_size=50288, chunk_size=256)
    return Mamba2ForCausalLM(cfg)


# name -> (model factory taking `quick`, (batch, sequence length)). Mamba2: HF's torch path materialises
# (chunks x chunks) decay matrices per layer; at 4 x 4096 tokens the eager training step needed more than the
# H200's 139 GiB and the forward alone took 9.6 s, so it runs one sequence of 4096.
MODELS: dict[str, tuple[Callable[[bool], torch.nn.Module], tuple[int, int]]] = {
    "llama-sdpa": (lambda q: _llama("sdpa", q), (2, 4096)),
    "llama-eager": (lambda q: _llama("eager", q), (2, 4096)),
    "llama-padded": (lambda q: _llama("sdpa", q), (8, 2048)),
    "llama-packed": (lambda q: _llama("sdpa", q), (1, 16384)),
    "mistral": (_mistral, (1, 8192)),
    "gemma2": (_gemma2, (2, 4096)),
    # Gemma-2-2B's attention geometry: head dim 256, 8 : 4 heads, window 4096
    "gemma2-d256": (lambda q: _gemma2(q, 2304, 9216, 8, 4, 256, 4096), (2, 8192)),
    "gpt2-medium": (_gpt2, (4, 2048)),
    "based": (_based, (4, 4096)),
    "mamba2": (_mamba2, (1, 4096)),
}


# Fine-tuning batches: "llama-padded" with a right-padded attention_mask (lengths drawn from [seq/4, seq]),
# "llama-packed" with sequences of lengths drawn from [512, 4096] packed into one row, told apart by position ids
# that restart (DataCollatorWithFlattening's format), from which HF builds the mask.
def _inputs(name: str, batch: int, seq: int) -> dict:
    """The model's keyword inputs besides the ids."""
    g = torch.Generator().manual_seed(0)
    if name == "llama-padded":
        lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
        return {"attention_mask": (torch.arange(seq)[None] < lengths[:, None]).long().cuda()}
    if name == "llama-packed":
        pos = torch.arange(seq).repeat(batch, 1)
        for b in range(batch):
            cuts = torch.randint(512, 4097, (seq // 512,), generator=g).cumsum(0)
            for c in cuts[cuts < seq].tolist():
                pos[b, c:] -= pos[b, c].item()
        return {"position_ids": pos.cuda()}
    return {}


# Training recipes: bf16 parameters, or fp32 parameters under bf16 / fp16 autocast (fp16 with a GradScaler), as
# HF Trainer's bf16=True / fp16=True and Lightning's bf16-mixed run them.
PRECISIONS = {"bf16": (torch.bfloat16, None), "amp-bf16": (torch.float32, torch.bfloat16),
              "amp-fp16": (torch.float32, torch.float16)}


def case_name(name: str, phase: str, precision: str = "bf16") -> str:
    batch, seq = MODELS[name][1]
    return f"{name} {batch}x{seq} {phase}" + ("" if precision == "bf16" else f" {precision}")


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _compile(model, mode: str):
    if mode in ("eager", HF_KERNELS):
        return model
    if mode == "torch.compile":
        # With the torch work-arounds our backend applies (tk_inductor._compat), so the ratio measures our kernels,
        # not the bug fixes: the CantSplit fix (without it torch 2.11's Inductor fails on Based-style models; it
        # changes no kernel) and split scans off (their codegen fails on HF Mamba2's cumsum; our backend turns
        # them off for any graph with a scan; the other models' scans are tiny: Llama's position ids).
        from .common import inductor_as_our_backend_runs_it

        inductor_as_our_backend_runs_it()
        return torch.compile(model)
    return torch.compile(model, backend="thunderkittens")


TIMED_S = 20.0  # timed budget per phase: slow models (Mamba2's torch path) get fewer calls, never fewer than 3


def bench_model(name: str, quick: bool = False, train: bool = True, modes: tuple[str, ...] = MODES,
                on_row: Callable[[Row], None] | None = None, precision: str = "bf16") -> list[Row]:
    import tk_inductor

    param_dtype, amp = PRECISIONS[precision]
    autocast = lambda: torch.autocast("cuda", dtype=amp, enabled=amp is not None)
    rows = []

    def add(row: Row) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for mode in modes:
        torch.manual_seed(0)
        factory, (batch, seq) = MODELS[name]
        model = factory(quick).to("cuda", param_dtype)
        ids = torch.randint(0, 32000, (batch, seq), device="cuda")
        extra = _inputs(name, batch, seq)
        tokens = batch * seq
        tk_inductor.reset()
        compiled = _compile(model, mode)
        for phase in ("forward", "train") if train else ("forward",):
            case = case_name(name, phase, precision)
            progress(f"e2e {case} [{mode}]")
            if phase == "forward":
                model.eval()

                def step():
                    with torch.no_grad(), autocast():
                        return _logits(compiled(ids, **extra))
            else:
                model.train()
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
                scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)

                def step():
                    with autocast():
                        loss = _logits(compiled(ids, **extra)).float().logsumexp(-1).mean()
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
            try:
                torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                first = time.perf_counter() - start  # includes compilation
                start = time.perf_counter()
                step()  # second call: a compile-free estimate of the step time
                torch.cuda.synchronize()
                iters = 3 if quick else max(3, min(10, int(TIMED_S / (time.perf_counter() - start))))
                ms = median_ms_events(step, iters=iters, warmup=0)
                peak = torch.cuda.max_memory_allocated() / 2**30
                note = f"first call {first:.1f} s, peak {peak:.1f} GiB"
                if mode == "thunderkittens":
                    r = tk_inductor.report()
                    note += f", replaced {r.replaced}"
                add(Row("e2e", case, mode, ms, tokens / ms * 1e3, "tokens/s", note=note))
                progress(f"  {ms:.2f} ms, {tokens / ms * 1e3:.0f} tokens/s, {note}")
            except Exception as exc:  # a baseline that fails (Inductor on Mamba2) is reported, not hidden
                add(Row("e2e", case, mode, None, note=f"failed: {type(exc).__name__}: {str(exc)[:160]}"))
                progress(f"  failed: {type(exc).__name__}: {str(exc)[:300]}")
        del model, compiled
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    return rows


def _child_cmd(name: str, mode: str, sink: Path, quick: bool, precision: str = "bf16") -> list[str]:
    return ([sys.executable, "-m", "benchmarks.e2e", "--child", name, mode, str(sink), "--precision", precision]
            + (["--quick"] if quick else []))


def _bench_in_child(name: str, mode: str, quick: bool, timeout_s: float, precision: str = "bf16") -> list[Row]:
    """bench_model(name, modes=(mode,)) in a fresh process; rows arrive as JSON lines, so the phases that finished
    before a time-out or a crash are kept, and the missing ones are reported with the reason."""
    with tempfile.TemporaryDirectory() as tmp:
        sink = Path(tmp) / "rows.jsonl"
        proc = subprocess.Popen(_child_cmd(name, mode, sink, quick, precision), start_new_session=True)  # own process group: compile workers go with it
        try:
            code = proc.wait(timeout=timeout_s)
            status = f"exited with status {code}" if code else "finished without a result"
        except subprocess.TimeoutExpired:
            status = f"did not finish within {timeout_s:.0f} s (compilation included)"
        finally:  # also when this process is stopped (SIGTERM from `timeout`): no child left on the GPU
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        lines = sink.read_text().splitlines() if sink.exists() else []
    rows = [Row(**json.loads(line)) for line in lines if line.strip()]
    done = {r.case for r in rows}
    for phase in ("forward", "train"):
        if case_name(name, phase, precision) not in done:
            rows.append(Row("e2e", case_name(name, phase, precision), mode, None, note=status))
            progress(f"  {name} {phase} [{mode}]: {status}")
    return rows


def run(quick: bool = False, models: list[str] | None = None, modes: list[str] | None = None,
        timeout_s: float = 1200.0, on_rows: Callable[[list[Row]], None] | None = None,
        precisions: list[str] | None = None) -> list[Row]:
    """Every (model, precision, mode) in its own process; on_rows gets each one's rows as they finish."""
    unknown = set(modes or ()) - set(MODES) - {HF_KERNELS}
    if unknown:
        raise ValueError(f"unknown e2e modes {sorted(unknown)}; choose from {MODES + (HF_KERNELS,)}")
    unknown = set(models or ()) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown e2e models {sorted(unknown)}; choose from {tuple(MODELS)}")
    unknown = set(precisions or ()) - set(PRECISIONS)
    if unknown:
        raise ValueError(f"unknown e2e precisions {sorted(unknown)}; choose from {tuple(PRECISIONS)}")
    rows = []
    for name in models or list(MODELS):
        for precision in precisions or ["bf16"]:
            for mode in modes or MODES + ((HF_KERNELS,) if name in HF_KERNELS_MODELS else ()):
                if mode == HF_KERNELS and name not in HF_KERNELS_MODELS:
                    continue
                part = _bench_in_child(name, mode, quick, timeout_s, precision)
                rows += part
                if on_rows is not None:
                    on_rows(part)
    return rows


def _child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "SINK"), required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--precision", default="bf16", choices=tuple(PRECISIONS))
    args = p.parse_args(argv)
    name, mode, sink = args.child

    def write(row: Row) -> None:
        with open(sink, "a") as f:
            f.write(json.dumps(dataclasses.asdict(row)) + "\n")

    missing = _hf_kernels_path(mode == HF_KERNELS)
    if missing:
        for phase in ("forward", "train"):
            write(Row("e2e", case_name(name, phase, args.precision), mode, None, note=missing))
        return 0
    bench_model(name, quick=args.quick, modes=(mode,), on_row=write, precision=args.precision)
    return 0


def _hf_kernels_path(wanted: bool) -> str | None:
    """Puts .mamba/ on sys.path for HF's fast path, or takes it off for the other modes (HF decides at import which
    path it takes); the reason HF's fast path cannot run, or None."""
    folder = str(MAMBA_DIR)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != folder]
    if not wanted:
        return None
    sys.path.insert(0, folder)
    try:
        import causal_conv1d  # noqa: F401  (mamba_ssm's fused training path calls its CUDA functions)
        from mamba_ssm.ops.triton.ssd_combined import mamba_split_conv1d_scan_combined  # noqa: F401
    except ImportError as exc:
        return f"missing: {exc.name} not importable (HF's fast path needs mamba_ssm and causal_conv1d in .mamba/)"
    return None


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
