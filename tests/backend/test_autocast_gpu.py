"""Mixed-precision training recipes on the GPU, with the kernels: fp32 parameters under CUDA autocast (bf16, and
fp16 with a GradScaler), and FSDP2's MixedPrecisionPolicy on a single-rank process group. The backend must replace
what it replaces in pure bf16, and the loss and gradients must match eager's same recipe."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import tk_inductor

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

VOCAB = 96


@pytest.fixture(autouse=True)
def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernels need sm_90")
    from tk_inductor import build

    for family in ("attention", "rotary", "layernorm"):
        build.load(family)


def _llama(attn: str, layers: int = 2):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _loss(model_out, ids):
    return F.cross_entropy(model_out.logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())


def _grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_rel(a: dict, b: dict) -> float:
    total = sum(g.pow(2).sum() for g in b.values()).sqrt()
    return (sum((a[n] - g).pow(2).sum() for n, g in b.items()).sqrt() / total).item()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_llama_autocast_fp32_params(attn, dtype):
    torch.manual_seed(0)
    eager = _llama(attn).cuda().train()
    ours = copy.deepcopy(eager)
    ids = torch.randint(0, VOCAB, (2, 333), device="cuda")  # not a tile multiple
    torch._dynamo.reset()
    tk_inductor.reset()
    compiled = torch.compile(ours, backend="thunderkittens")
    losses = []
    for model, run in ((eager, eager), (ours, compiled)):
        with torch.autocast("cuda", dtype=dtype):
            out = run(input_ids=ids)
        loss = _loss(out, ids)
        # fp16: a GradScaler's constant scale (the gradients are unscaled before comparing)
        (loss * (1024.0 if dtype == torch.float16 else 1.0)).backward()
        losses.append((out.logits, loss))
    (ref_logits, ref_loss), (logits, loss) = losses
    assert logits.dtype == ref_logits.dtype
    assert torch.isfinite(logits).all()
    assert _rel(logits, ref_logits) < 2e-2 and _rel(loss, ref_loss) < 1e-2
    assert _grad_rel(_grads(ours), _grads(eager)) < 3e-2
    rep = tk_inductor.report()
    assert not rep.failed, rep.failed
    assert rep.replaced.get("attention") == 2 and rep.replaced.get("layernorm") == 5, str(rep)
    assert rep.replaced.get("rotary", 0) >= 2, str(rep)


def test_llama_fsdp2_mixed_precision_single_rank():
    """fully_shard with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on one rank: the same swaps as
    pure bf16, and eager FSDP2's loss and gradients."""
    import torch.distributed as dist

    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 fully_shard")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        torch.manual_seed(0)
        base = _llama("sdpa").cuda().train()
        models = []
        for _ in range(2):
            m = copy.deepcopy(base)
            for layer in m.model.layers:
                fsdp.fully_shard(layer, mp_policy=policy)
            fsdp.fully_shard(m, mp_policy=policy)
            models.append(m)
        eager, ours = models
        ids = torch.randint(0, VOCAB, (2, 257), device="cuda")
        torch._dynamo.reset()
        tk_inductor.reset()
        compiled = torch.compile(ours, backend="thunderkittens")
        ref_loss = _loss(eager(input_ids=ids), ids)
        ref_loss.backward()
        loss = _loss(compiled(input_ids=ids), ids)
        loss.backward()
        assert _rel(loss, ref_loss) < 1e-2
        ga = {n: p.grad.full_tensor().float() for n, p in ours.named_parameters() if p.grad is not None}
        gb = {n: p.grad.full_tensor().float() for n, p in eager.named_parameters() if p.grad is not None}
        assert ga.keys() == gb.keys() and _grad_rel(ga, gb) < 3e-2
        rep = tk_inductor.report()
        assert not rep.failed, rep.failed
        for family in ("attention", "rotary", "layernorm"):
            assert rep.replaced.get(family, 0) >= 1, str(rep)
    finally:
        if created:
            dist.destroy_process_group()
