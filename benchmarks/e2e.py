"""Whole models: eager vs torch.compile default vs backend="thunderkittens".

Forward (inference, no grad) and a full training step (forward, backward,
AdamW step), tokens/s and peak memory, plus torch.compile wall time. Models
are built from configs with random weights (nothing is downloaded).
"""
from __future__ import annotations

import gc
import time
from typing import Callable

import torch

from .common import Row, median_ms_events, progress

MODES = ("eager", "torch.compile", "thunderkittens")


def _llama(attn: str, quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8,
        num_hidden_layers=4 if quick else 16, vocab_size=32000, max_position_embeddings=8192,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg), (2, 4096)


def _gpt2(quick: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=1024, n_layer=4 if quick else 24, n_head=16, n_positions=4096,
                     attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg), (4, 2048)


def _based(quick: bool):
    from .models.based import BasedConfig, BasedLM

    return BasedLM(BasedConfig(layers=3 if quick else 12)), (4, 4096)


def _mamba2(quick: bool):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(hidden_size=1024, num_hidden_layers=4 if quick else 48, state_size=128, head_dim=64,
                       num_heads=32, n_groups=1, expand=2, vocab_size=50288, chunk_size=256)
    # HF's torch path materialises (chunks x chunks) decay matrices per layer: at 4 x 4096 tokens the eager training
    # step needs more than the H200's 139 GiB, and the forward alone took 9.6 s; one sequence of 4096 fits.
    return Mamba2ForCausalLM(cfg), (1, 4096)


MODELS: dict[str, Callable[[bool], tuple]] = {
    "llama-sdpa": lambda q: _llama("sdpa", q),
    "llama-eager": lambda q: _llama("eager", q),
    "gpt2-medium": _gpt2,
    "based": _based,
    "mamba2": _mamba2,
}


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _compile(model, mode: str):
    if mode == "eager":
        return model
    if mode == "torch.compile":
        return torch.compile(model)
    return torch.compile(model, backend="thunderkittens")


def bench_model(name: str, quick: bool = False, train: bool = True, modes: tuple[str, ...] = MODES) -> list[Row]:
    import tk_inductor

    rows = []
    for mode in modes:
        torch.manual_seed(0)
        model, (batch, seq) = MODELS[name](quick)
        model = model.to("cuda", torch.bfloat16)
        ids = torch.randint(0, 32000, (batch, seq), device="cuda")
        tokens = batch * seq
        tk_inductor.reset()
        compiled = _compile(model, mode)
        for phase in ("forward", "train") if train else ("forward",):
            case = f"{name} {batch}x{seq} {phase}"
            progress(f"e2e {case} [{mode}]")
            if phase == "forward":
                model.eval()

                def step():
                    with torch.no_grad():
                        return _logits(compiled(ids))
            else:
                model.train()
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

                def step():
                    loss = _logits(compiled(ids)).float().logsumexp(-1).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            try:
                torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                first = time.perf_counter() - start  # includes compilation
                ms = median_ms_events(step, iters=3 if quick else 10, warmup=1)
                peak = torch.cuda.max_memory_allocated() / 2**30
                note = f"first call {first:.1f} s, peak {peak:.1f} GiB"
                if mode == "thunderkittens":
                    r = tk_inductor.report()
                    note += f", replaced {r.replaced}"
                rows.append(Row("e2e", case, mode, ms, tokens / ms * 1e3, "tokens/s", note=note))
                progress(f"  {ms:.2f} ms, {tokens / ms * 1e3:.0f} tokens/s, {note}")
            except Exception as exc:  # a baseline that fails (Inductor on Mamba2) is reported, not hidden
                rows.append(Row("e2e", case, mode, None, note=f"failed: {type(exc).__name__}: {str(exc)[:160]}"))
                progress(f"  failed: {type(exc).__name__}: {str(exc)[:300]}")
        del model, compiled
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    return rows


def run(quick: bool = False, models: list[str] | None = None, modes: list[str] | None = None) -> list[Row]:
    unknown = set(modes or ()) - set(MODES)
    if unknown:
        raise ValueError(f"unknown e2e modes {sorted(unknown)}; choose from {MODES}")
    rows = []
    for name in models or list(MODELS):
        rows += bench_model(name, quick=quick, modes=tuple(modes or MODES))
    return rows
