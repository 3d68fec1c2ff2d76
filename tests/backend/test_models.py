"""Tiny Hugging Face models from random configs (no downloads), compiled with the backend.

In reference mode every `tk::` op runs its PyTorch reference, so on a CPU the
compiled model must equal eager in fp32 (forward and every parameter's
gradient) and the report must show the expected families replaced. A family
whose matcher (patterns/<family>.py) has not landed yet skips its models.
The GPU test runs the real kernels in bf16.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
from typing import Callable

import pytest
import torch

import tk_inductor
from tolerance import summed

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _llama(attn: str, layers: int = 2):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,  # GQA 2:1
        max_position_embeddings=128, attention_dropout=0.0, attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg)


def _mistral(attn: str):  # a sliding window shorter than the test's 24 tokens
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=128, sliding_window=8, attn_implementation=attn,
    )
    return transformers.MistralForCausalLM(cfg)


def _gemma2():  # softcapped scores on every layer, a sliding window on alternate ones (eager: HF has no SDPA path)
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=128, sliding_window=8,
        attn_logit_softcapping=1.0, query_pre_attn_scalar=64, attn_implementation="eager",
    )
    return transformers.Gemma2ForCausalLM(cfg)


def _phi3():  # head dim 96 (the D = 128 kernels, zero-filled) and a sliding window
    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=7, pad_token_id=0, eos_token_id=0,
        bos_token_id=0, attn_implementation="sdpa",
    )
    return transformers.Phi3ForCausalLM(cfg)


def _phi():  # head dim 80, partial rotary
    cfg = transformers.PhiConfig(
        vocab_size=VOCAB, hidden_size=160, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=128, partial_rotary_factor=0.4, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        attn_implementation="sdpa",
    )
    return transformers.PhiForCausalLM(cfg)


def _qwen2_window():  # a sliding window on the layers from max_window_layers on, full causal below
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, use_sliding_window=True, sliding_window=6,
        max_window_layers=1, attn_implementation="sdpa",
    )
    return transformers.Qwen2ForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=128, n_head=2, n_layer=2, n_positions=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=128, num_attention_heads=2, num_hidden_layers=2, intermediate_size=256,
        max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertModel(cfg, add_pooling_layer=False)


def _neox():
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=128, num_attention_heads=2, num_hidden_layers=2, intermediate_size=256,
        rotary_pct=0.25,  # partial rotary: 16 of 64 channels rotate
        max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return transformers.GPTNeoXForCausalLM(cfg)


def _mamba2():
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=1,
        expand=2, num_hidden_layers=2, chunk_size=8, conv_kernel=4,
    )
    return transformers.Mamba2ForCausalLM(cfg)


def _deepseek_v3():  # multi-head latent attention: q/k head dim 24 (16 + 8 rotary), v head dim 16; dense layers
    # (the experts' routing reads values on the host, which torch 2.11's AOTAutograd cannot trace)
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V3")
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
        first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=128,
    )
    return transformers.DeepseekV3ForCausalLM(cfg)


def _modernbert():  # an encoder: global attention and a two-sided window (local attention 8: 4 keys each side)
    if not hasattr(transformers, "ModernBertConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no ModernBERT")
    cfg = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2,
        local_attention=8, max_position_embeddings=128, attention_dropout=0.0, embedding_dropout=0.0,
        mlp_dropout=0.0,
    )
    return transformers.ModernBertModel(cfg)


def _gpt_oss():  # attention sinks (eager only), a sliding window on alternate layers, mixture of experts
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss")
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 12):
        pytest.skip("torch 2.11's AOTAutograd cannot trace gpt-oss's experts (aten._local_scalar_dense, aot_eager "
                    "alike): the graph breaks make the attention weights a graph output, kept for that reason")
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
        max_position_embeddings=128,
    )
    return transformers.GptOssForCausalLM(cfg)


def _llama4():  # chunked attention (chunks of 8 over the test's 24 tokens) on one layer, no rotary on the other
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Llama-4")
    cfg = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, intermediate_size_mlp=128, attention_chunk_size=8, num_local_experts=1,
        interleave_moe_layer_step=1, moe_layers=[], no_rope_layers=[1, 0],
        layer_types=["chunked_attention", "full_attention"], max_position_embeddings=128,
    )
    return transformers.Llama4ForCausalLM(cfg)


def _tiny(config: str, model: str, **extra):
    """A two-layer model of transformers' `config` / `model` classes (skipped where this transformers lacks them)."""
    if not hasattr(transformers, config):
        pytest.skip(f"transformers {transformers.__version__} has no {config}")
    cfg = getattr(transformers, config)(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=128, pad_token_id=0, attn_implementation="sdpa",
        **extra)
    return getattr(transformers, model)(cfg)


# Cohere: CohereLayerNorm written out (mean, biased variance, rsqrt, weight in fp32), GPT-J's interleaved rotary on
# q.float(); ERNIE 4.5: the interleaved rotary on q.float() with rotate_half(q).float(); HunYuan: q/k RMSNorms after
# the rotary (whose sum the norm must not take for a residual add).
_cohere = lambda: _tiny("CohereConfig", "CohereForCausalLM")
_ernie = lambda: _tiny("Ernie4_5Config", "Ernie4_5ForCausalLM")
_hunyuan = lambda: _tiny("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM")


def _padding_mask(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 4:] = 0  # the second sequence is right-padded
    return mask


@dataclasses.dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    replaced: tuple[str, ...]  # families the report must show
    attention_count: int | None = None  # exact, when attention is replaced: one per layer
    kept: tuple[str, ...] = ()  # families that must not be replaced
    padding_mask: bool = False


CASES = {
    "llama-sdpa": Case(lambda: _llama("sdpa"), ("attention", "rotary", "layernorm"), attention_count=2),
    "llama-eager": Case(lambda: _llama("eager"), ("attention", "rotary", "layernorm"), attention_count=2),
    "mistral-sdpa": Case(lambda: _mistral("sdpa"), ("attention", "rotary", "layernorm"), attention_count=2),
    "mistral-eager": Case(lambda: _mistral("eager"), ("attention", "rotary", "layernorm"), attention_count=2),
    "gemma2": Case(_gemma2, ("attention", "rotary", "layernorm"), attention_count=2),
    "phi3": Case(_phi3, ("attention", "rotary", "layernorm"), attention_count=2),
    "phi": Case(_phi, ("attention", "rotary", "layernorm"), attention_count=2),
    "qwen2-window": Case(_qwen2_window, ("attention", "rotary", "layernorm"), attention_count=2),
    "gpt2": Case(_gpt2, ("attention", "layernorm"), attention_count=2),
    "bert-padding": Case(_bert, ("attention", "layernorm"), attention_count=2, padding_mask=True),
    "gpt-neox": Case(_neox, ("attention", "rotary", "layernorm"), attention_count=2),
    "mamba2": Case(_mamba2, ("ssd", "layernorm")),
    "deepseek-v3": Case(_deepseek_v3, ("attention", "layernorm"), attention_count=2),
    "modernbert": Case(_modernbert, ("attention", "layernorm"), attention_count=2),
    "gpt-oss": Case(_gpt_oss, ("attention", "rotary", "layernorm"), attention_count=2),
    "llama4-chunked": Case(_llama4, ("attention", "rotary", "layernorm"), attention_count=2),
    "modernbert-padding": Case(_modernbert, ("attention", "layernorm"), attention_count=2, padding_mask=True),
    "gpt-oss-padding": Case(_gpt_oss, ("attention", "rotary", "layernorm"), attention_count=2, padding_mask=True),
    "cohere": Case(_cohere, ("attention", "rotary", "layernorm"), attention_count=2),
    "ernie4_5": Case(_ernie, ("attention", "rotary", "layernorm"), attention_count=2),
    "hunyuan": Case(_hunyuan, ("attention", "rotary", "layernorm"), attention_count=2),
}


def _skip_missing(families) -> None:
    missing = [f for f in families if importlib.util.find_spec(f"tk_inductor.patterns.{f}") is None]
    if missing:
        pytest.skip(f"patterns/{missing[0]}.py has not landed yet")


def _run(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask) if mask is not None else model(input_ids=ids)
    return out[0]


def _forward_backward(model, run, ids, mask, weight):
    """`run` is the model itself or its compiled wrapper; both share `model`'s parameters."""
    model.zero_grad(set_to_none=True)
    out = _run(run, ids, mask)
    (out * weight).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _assert_equal_to_eager(model, compiled, ids, mask, slack: float = 4.0):
    torch.manual_seed(1)
    weight = torch.randn(*ids.shape, model.config.vocab_size if hasattr(model, "lm_head") else model.config.hidden_size)
    out_ref, grads_ref = _forward_backward(model, model, ids, mask, weight)
    out, grads = _forward_backward(model, compiled, ids, mask, weight)
    # Every parameter gradient sums over the tokens, and each backward matmul over the hidden size.
    terms = ids.numel() * model.config.hidden_size
    torch.testing.assert_close(out, out_ref, **summed(out_ref, model.config.hidden_size, slack))
    assert grads.keys() == grads_ref.keys() and grads_ref
    floor = 1e-2 * max(g.abs().max().item() for g in grads_ref.values())
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], **summed(grads_ref[name], terms, slack, floor),
                                   msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_model_matches_eager_in_reference_mode(name):
    case = CASES[name]
    _skip_missing(case.replaced + case.kept)
    torch.manual_seed(0)
    model = case.build().train()  # training (dropout p=0): gradients must flow through the tk ops
    ids = torch.randint(0, VOCAB, (2, 24))
    mask = _padding_mask(2, 24) if case.padding_mask else None
    compiled = torch.compile(model, backend="thunderkittens", options={"reference": True, "inner": "aot_eager"})
    _assert_equal_to_eager(model, compiled, ids, mask)

    rep = tk_inductor.report()
    assert not rep.failed, rep.failed
    for family in case.replaced:
        assert rep.replaced.get(family, 0) >= 1, f"{family} not replaced in {name}: {rep}"
    if case.attention_count is not None:
        assert rep.replaced["attention"] == case.attention_count, str(rep)
    for family in case.kept:
        assert family not in rep.replaced, f"{family} must not be replaced in {name}: {rep}"
        assert any(f == family for f, _ in rep.kept), str(rep)


def test_llama_left_padding_through_inductor():
    """A left-padded batch (generation's prefill) through real Inductor: the padding mask's slice reaches
    tk::attention_varlen, and every position equals eager, rows before the first token included."""
    _skip_missing(("attention",))
    torch.manual_seed(0)
    model = _llama("sdpa").eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0
    compiled = torch.compile(model, backend="thunderkittens", options={"reference": True})
    with torch.no_grad():
        torch.testing.assert_close(_run(compiled, ids, mask), _run(model, ids, mask), rtol=1e-4, atol=1e-4)
    assert tk_inductor.report().replaced.get("attention") == 2, str(tk_inductor.report())


@pytest.mark.parametrize("build", [_llama4, _gpt_oss], ids=["llama4-chunked", "gpt-oss"])
def test_left_padding_with_chunks_or_sinks(build):
    """Under left padding (batched generation's prefill, fine-tuning on left-padded batches) both layers are replaced
    and a training step equals eager: Llama-4's chunks count from each row's first token (HF's mask subtracts the
    padding mask's leading-zero count: chunk boundaries differ per row); gpt-oss's sinks rescale tk::attention_varlen's
    o by its lse (rows that see no key: o = 0, all the mass on the sink)."""
    _skip_missing(("attention",))
    torch.manual_seed(0)
    model = build().train()
    ids = torch.randint(0, VOCAB, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, :11] = 0
    compiled = torch.compile(model, backend="thunderkittens", options={"reference": True, "inner": "aot_eager"})
    _assert_equal_to_eager(model, compiled, ids, mask)
    assert tk_inductor.report().replaced.get("attention") == 2, str(tk_inductor.report())


def test_llama_through_inductor_and_new_sequence_length():
    """Real Inductor on the rewritten graph; a second length recompiles with dynamic shapes."""
    _skip_missing(("attention", "rotary", "layernorm"))
    torch.manual_seed(0)
    model = _llama("sdpa").train()
    compiled = torch.compile(model, backend="thunderkittens", options={"reference": True})
    # Inductor also fuses and reorders fp32 reductions across kernels: more slack than aot_eager needs.
    _assert_equal_to_eager(model, compiled, torch.randint(0, VOCAB, (2, 16)), None, slack=32.0)
    first = dict(tk_inductor.report().replaced)
    _assert_equal_to_eager(model, compiled, torch.randint(0, VOCAB, (2, 11)), None, slack=32.0)
    assert first["attention"] == 2
    assert tk_inductor.report().replaced["attention"] == 4, str(tk_inductor.report())


def test_allowlist_on_a_model():
    _skip_missing(("attention", "rotary", "layernorm"))
    model = _llama("eager").eval()
    ids = torch.randint(0, VOCAB, (1, 10))
    compiled = torch.compile(model, backend="thunderkittens", options={"reference": True, "inner": "aot_eager", "ops": ["rotary"]})
    with torch.no_grad():
        torch.testing.assert_close(_run(compiled, ids, None), _run(model, ids, None), rtol=1e-4, atol=1e-5)
    rep = tk_inductor.report()
    assert set(rep.replaced) == {"rotary"}
    assert {f for f, r in rep.kept if r == "not in the ops allowlist"} >= {"attention", "layernorm"}


# ---------------------------------------------------------------------------- GPU: the real kernels


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
def test_llama_bf16_cuda_kernels_forward_and_training_step():
    from tk_inductor import build

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip("the kernels need sm_90")
    _skip_missing(("attention", "rotary", "layernorm"))
    torch.manual_seed(0)
    eager = _llama("sdpa", layers=2).cuda().bfloat16().train()
    ours = _llama("sdpa", layers=2).cuda().bfloat16().train()
    ours.load_state_dict(eager.state_dict())
    compiled = torch.compile(ours, backend="thunderkittens")
    ids = torch.randint(0, VOCAB, (2, 200), device="cuda")  # not a tile multiple: tails are masked in-kernel
    labels = torch.randint(0, VOCAB, (2, 200), device="cuda")

    opt_eager = torch.optim.SGD(eager.parameters(), lr=1e-2)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=1e-2)
    out_eager = eager(input_ids=ids, labels=labels)
    out_ours = compiled(input_ids=ids, labels=labels)
    assert torch.isfinite(out_ours.logits).all()
    assert _rel_err(out_ours.logits, out_eager.logits) <= 1e-2
    out_eager.loss.backward()
    out_ours.loss.backward()
    for (name, p_ref), p in zip(eager.named_parameters(), ours.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert _rel_err(p.grad, p_ref.grad) <= 3e-2, name
    opt_eager.step()
    opt_ours.step()
    with torch.no_grad():
        after = _rel_err(compiled(input_ids=ids).logits, eager(input_ids=ids).logits)
    assert after <= 1e-2

    rep = tk_inductor.report()
    assert not rep.failed, rep.failed
    for family in ("attention", "rotary", "layernorm"):
        if family in build.families():  # a family with kernel sources must really run them
            assert rep.replaced.get(family, 0) >= 1, f"{family}: {rep}"


def _compiled_matches_eager(model, ids, family, outputs=lambda out: out, train=False):
    """Compiled bf16 on CUDA equals eager within bf16 tolerance, and `family` ran as our kernel. In training (one
    forward and backward) every parameter's gradient is compared with an fp32 copy of the model: within 3e-2, or no
    more than 1.5x off than eager bf16's own (sums over every token, e.g. Mamba2's dt_bias, cancel to small values
    that bf16 does not resolve to 3e-2 either way)."""
    from tk_inductor import build, config

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernels need sm_90")
    _skip_missing((family,))
    torch._dynamo.reset()
    tk_inductor.reset()
    model.train(train)
    ours = copy.deepcopy(model)
    exact = copy.deepcopy(model).float()
    with config.patch(reference_backward=[family] if train else []), torch.set_grad_enabled(train):
        compiled = torch.compile(ours, backend="thunderkittens")
        want, got = outputs(model(ids)), outputs(compiled(ids))
        assert torch.isfinite(got).all()
        assert _rel_err(got, want) <= 2e-2
        if train:
            for out in (want, got, outputs(exact(ids))):
                out.float().square().mean().backward()
            for (name, p_eager), p, p_exact in zip(model.named_parameters(), ours.parameters(), exact.parameters()):
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
                err, eager_err = _rel_err(p.grad, p_exact.grad), _rel_err(p_eager.grad, p_exact.grad)
                assert err <= max(3e-2, 1.5 * eager_err), f"{name}: {err:.3g} vs fp32 (eager bf16: {eager_err:.3g})"
    rep = tk_inductor.report()
    assert not rep.failed, rep.failed
    if family in build.families():
        assert rep.replaced.get(family, 0) >= 1, f"{family}: {rep}"


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_based_bf16_cuda_kernel(train):
    """The benchmark's Based LM, small: its Taylor layers run the Based kernel (dk 16, dv 64)."""
    from tk_inductor.models.based import BasedConfig, BasedLM

    torch.manual_seed(0)
    model = BasedLM(BasedConfig(vocab_size=VOCAB, hidden=256, layers=2, heads=4)).cuda().bfloat16()
    ids = torch.randint(0, VOCAB, (2, 333), device="cuda")  # not a chunk multiple
    _compiled_matches_eager(model, ids, "linear_attention", train=train)


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_mamba2_bf16_cuda_kernel(train):
    """HF Mamba2 (torch path) at kernel sizes, state 64 and head dim 64: its scan runs the SSD kernel."""
    if importlib.util.find_spec("mamba_ssm") is not None:  # (benchmarks/e2e.py's mode mamba_ssm times that path)
        pytest.skip("mamba_ssm is importable: HF Mamba2 runs its kernels, not the torch path the backend matches")
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=128, num_heads=4, head_dim=64, state_size=64,
                                    n_groups=1, expand=2, num_hidden_layers=2, chunk_size=64, conv_kernel=4)
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(cfg).cuda().bfloat16()
    ids = torch.randint(0, VOCAB, (2, 300), device="cuda")
    _compiled_matches_eager(model, ids, "ssd", outputs=lambda out: out.logits, train=train)
