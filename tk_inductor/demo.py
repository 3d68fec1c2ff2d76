"""`python -m tk_inductor demo`: the backend on a built-in Llama-style model, nothing to download.

On an sm_90 GPU (H100/H200) it builds the kernels (first run only), compiles the model with
`backend="thunderkittens"` and with default `torch.compile`, prints the report, checks the outputs
against eager and times a forward and a training step of each. Anywhere else it runs the same rewrite
in reference mode (every swapped op runs its plain PyTorch reference) and checks that the compiled
model's outputs and gradients equal eager's.

The model (tk_inductor/models/llama.py) is written the way Hugging Face's Llama is, so what the demo
swaps is what the matchers find in real model code. `--hf` uses transformers' LlamaForCausalLM instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._timing import median_ms_events
from .models.llama import TINY, Llama, LlamaConfig


def _hf_llama(cfg: LlamaConfig):
    try:
        import transformers
    except ImportError:
        raise SystemExit("tk_inductor demo --hf: transformers is not installed (pip install transformers)")
    hf = transformers.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                                  num_hidden_layers=cfg.layers, rms_norm_eps=cfg.eps, max_position_embeddings=8192,
                                  attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(hf)

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    return Logits()


def _say(message: str) -> None:
    print(message, flush=True)


def _loss(logits, ids):
    return F.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _precision(name: str):
    """(parameter dtype, autocast dtype or None)."""
    return {"bf16": (torch.bfloat16, None), "amp-bf16": (torch.float32, torch.bfloat16),
            "amp-fp16": (torch.float32, torch.float16), "fp32": (torch.float32, None)}[name]


def _build_kernels() -> None:
    from . import build

    for family in ("attention", "rotary", "layernorm"):
        if build.is_built(family):
            continue
        _say(f"building the {family} kernels (first run only; about a minute per family on 16 cores)...")
        start = time.time()
        build.load(family)
        _say(f"  built in {time.time() - start:.0f} s")


def _cpu_demo(args, cfg: LlamaConfig) -> int:
    import tk_inductor

    why = "no CUDA device" if not torch.cuda.is_available() else f"{torch.cuda.get_device_name()} is not sm_90"
    _say(f"{why}: running the rewrite in reference mode (each swapped op runs its PyTorch reference) on the CPU")
    _, amp = _precision(args.precision)
    if amp is not None:
        _say(f"fp32 parameters under CPU autocast ({args.precision})")
    torch.manual_seed(0)
    model = (_hf_llama(cfg) if args.hf else Llama(cfg)).float()
    ids = torch.randint(0, cfg.vocab, (2, args.seq or 64))
    compiled = torch.compile(model, backend="thunderkittens", options={"reference": True, "inner": "aot_eager"})
    tk_inductor.reset()

    def step(run):
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            logits = run(ids)
        loss = _loss(logits, ids)
        loss.backward()
        return loss

    ref_loss = step(model)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = step(compiled)
    _say(str(tk_inductor.report()))
    worst = max(_rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters())
    # fp32: the same math in another order; autocast: eager rounds its intermediates to 16 bits, the ops do not
    loss_tol, grad_tol = (1e-5, 1e-4) if amp is None else (1e-2, 3e-2)
    ok = abs(loss.item() - ref_loss.item()) <= loss_tol * abs(ref_loss.item()) and worst <= grad_tol
    _say(f"loss {loss.item():.6f} (eager {ref_loss.item():.6f}); largest gradient relative error {worst:.1e}")
    _say(("outputs and gradients equal eager" + (" autocast (within its 16-bit rounding)" if amp else "")) if ok
         else "MISMATCH against eager")
    return 0 if ok else 1


def _gpu_demo(args, cfg: LlamaConfig) -> int:
    import tk_inductor

    param_dtype, amp = _precision(args.precision)
    _say(f"{torch.cuda.get_device_name()}: {'HF ' if args.hf else ''}Llama-style model, hidden {cfg.hidden}, "
         f"{cfg.layers} layers, {cfg.heads} heads ({cfg.kv_heads} KV), batch 2 x {args.seq or 4096} tokens, {args.precision}")
    _build_kernels()
    torch.manual_seed(0)
    model = (_hf_llama(cfg) if args.hf else Llama(cfg)).to("cuda", param_dtype)
    ids = torch.randint(0, cfg.vocab, (2, args.seq or 4096), device="cuda")
    autocast = torch.autocast("cuda", dtype=amp, enabled=amp is not None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)

    def forward(run):
        with torch.no_grad(), autocast:
            return run(ids)

    def train(run):
        with autocast:
            loss = _loss(run(ids), ids)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    results = {}
    reference = forward(model)
    for name in ("thunderkittens", "torch.compile"):
        torch._dynamo.reset()
        tk_inductor.reset()
        run = torch.compile(model, backend="thunderkittens") if name == "thunderkittens" else torch.compile(model)
        _say(f"compiling with {name} (forward, then the training step)...")
        start = time.time()
        out = forward(run)
        train(run)
        _say(f"  compiled in {time.time() - start:.0f} s")
        if name == "thunderkittens":
            _say(str(tk_inductor.report()))
            err = _rel_err(out, reference)
            _say(f"  logits against eager: relative error {err:.1e}" + ("" if err < 2e-2 else "  (LARGER than expected)"))
        results[name] = (median_ms_events(lambda: forward(run), args.iters, 1),
                         median_ms_events(lambda: train(run), args.iters, 1))
    (ours_f, ours_t), (base_f, base_t) = results["thunderkittens"], results["torch.compile"]
    _say(f"forward:       thunderkittens {ours_f:7.2f} ms   torch.compile {base_f:7.2f} ms   {base_f / ours_f:.2f}x")
    _say(f"training step: thunderkittens {ours_t:7.2f} ms   torch.compile {base_t:7.2f} ms   {base_t / ours_t:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tk-inductor demo", description=__doc__.splitlines()[0])
    p.add_argument("--hf", action="store_true", help="use transformers' LlamaForCausalLM (needs transformers)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "amp-bf16", "amp-fp16", "fp32"),
                   help="bf16 parameters (GPU; fp32 in the CPU check), or fp32 parameters under bf16/fp16 autocast "
                        "(default bf16)")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default 4 on a GPU, 2 on a CPU)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 4096 on a GPU, 64 on a CPU)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per measurement (GPU)")
    p.add_argument("--cpu", action="store_true", help="the reference-mode check even when an sm_90 GPU is present")
    args = p.parse_args(argv)
    gpu = _sm90() and not args.cpu
    cfg = LlamaConfig() if gpu else TINY
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    return _gpu_demo(args, cfg) if gpu else _cpu_demo(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
