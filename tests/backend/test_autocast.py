"""Mixed precision and dynamic shapes on the CPU, in reference mode: under `torch.autocast` (fp32 parameters,
bf16 or fp16 compute) the backend replaces what it replaces in one precision, and the compiled model gives eager
autocast's dtypes and values (loss and gradients within 1e-2 relative). tk_inductor/autocast.py makes autocast's
casts explicit before matching; the GPU tests (test_autocast_gpu.py) run the same recipes on the kernels."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor import autocast, rewrite

transformers = pytest.importorskip("transformers")

VOCAB = 96
OPTS = {"reference": True, "inner": "aot_eager"}


def _llama(attn: str):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   max_position_embeddings=128, attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    return transformers.Qwen2ForCausalLM(cfg)


def _neox():
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=128, num_attention_heads=2, num_hidden_layers=2,
                                     intermediate_size=256, rotary_pct=0.25, max_position_embeddings=128,
                                     hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.GPTNeoXForCausalLM(cfg)


def _gemma():
    cfg = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   max_position_embeddings=128)
    return transformers.GemmaForCausalLM(cfg)


def _gemma2():  # softcapped scores (eager, bf16 under autocast) and a window on alternate layers
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                    max_position_embeddings=128, sliding_window=8, attn_logit_softcapping=1.0,
                                    query_pre_attn_scalar=64, attn_implementation="eager")
    return transformers.Gemma2ForCausalLM(cfg)


def _mistral():  # a sliding window (SDPA with the window's mask)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                     max_position_embeddings=128, sliding_window=8, attn_implementation="sdpa")
    return transformers.MistralForCausalLM(cfg)


def _mamba2():
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
                                    n_groups=1, expand=2, num_hidden_layers=2, chunk_size=8, conv_kernel=4)
    return transformers.Mamba2ForCausalLM(cfg)


def _needs(config_name: str, min_torch=(2, 11)):
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < min_torch:
        pytest.skip(f"torch {torch.__version__}: see tests/backend/test_models.py")


def _deepseek_v3():  # MLA: q/k head dim 24, v head dim 16 (dense layers)
    _needs("DeepseekV3Config")
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _gpt_oss():  # attention sinks, a window on alternate layers
    _needs("GptOssConfig", (2, 12))
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=128, num_local_experts=2,
                                    num_experts_per_tok=1, sliding_window=8, max_position_embeddings=128)
    return transformers.GptOssForCausalLM(cfg)


def _modernbert():  # an encoder with a two-sided window (masked LM logits over the vocabulary)
    _needs("ModernBertConfig")
    cfg = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2,
                                        local_attention=8, max_position_embeddings=128)
    return transformers.ModernBertForMaskedLM(cfg)


def _tiny(config: str, model: str):  # Cohere, ERNIE 4.5, HunYuan: their norm and rotary spellings (test_models)
    def build():
        _needs(config)
        cfg = getattr(transformers, config)(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=64, max_position_embeddings=128, pad_token_id=0)
        return getattr(transformers, model)(cfg)
    return build


# model -> the families replaced in one precision, with their counts (2 layers; rotary: at least, q and k of a
# layer share a launch where both results are cast for attention)
MODELS = {
    "llama-sdpa": (lambda: _llama("sdpa"), {"attention": 2, "layernorm": 5, "rotary": 2}),
    "llama-eager": (lambda: _llama("eager"), {"attention": 2, "layernorm": 5, "rotary": 2}),
    "qwen2": (_qwen2, {"attention": 2, "layernorm": 5, "rotary": 2}),
    "gpt-neox": (_neox, {"attention": 2, "layernorm": 5, "rotary": 2}),
    "gemma": (_gemma, {"attention": 2, "layernorm": 5, "rotary": 2}),
    "gemma2": (_gemma2, {"attention": 2, "layernorm": 9, "rotary": 2}),
    "mistral": (_mistral, {"attention": 2, "layernorm": 5, "rotary": 2}),
    # the SSD in fp32 under autocast's bf16 einsums; the gated norms (MambaRMSNormGated) with their gate
    "mamba2": (_mamba2, {"ssd": 2, "layernorm": 5}),
    "deepseek-v3": (_deepseek_v3, {"attention": 2}),
    "gpt-oss": (_gpt_oss, {"attention": 2, "rotary": 2}),
    "modernbert": (_modernbert, {"attention": 2}),
    "cohere": (_tiny("CohereConfig", "CohereForCausalLM"), {"attention": 2, "layernorm": 3, "rotary": 2}),
    "ernie4_5": (_tiny("Ernie4_5Config", "Ernie4_5ForCausalLM"), {"attention": 2, "layernorm": 5, "rotary": 2}),
    "hunyuan": (_tiny("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM"),
                {"attention": 2, "layernorm": 9, "rotary": 2}),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _step(model, run, ids, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype):
        logits = run(input_ids=ids).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _replaced(rep) -> dict:
    return {f: n for f, n in rep.replaced.items()}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_model_under_autocast_matches_eager_and_replaces_as_in_fp32(name, dtype):
    build, expected = MODELS[name]
    torch.manual_seed(0)
    model = build().train()
    ids = torch.randint(0, VOCAB, (2, 24))
    tk_inductor.reset()
    compiled = torch.compile(model, backend="thunderkittens", options=OPTS)
    ref_logits, ref_loss, ref_grads = _step(model, model, ids, dtype)
    logits, loss, grads = _step(model, compiled, ids, dtype)
    rep = tk_inductor.report()
    assert not rep.failed, rep.failed
    replaced = _replaced(rep)
    for family, count in expected.items():
        assert replaced.get(family, 0) == count or (family == "rotary" and replaced.get(family, 0) >= count), str(rep)
    assert logits.dtype == ref_logits.dtype
    assert _rel(loss, ref_loss) < 1e-2 and _rel(logits, ref_logits) < 1e-2
    assert grads.keys() == ref_grads.keys()
    total = sum(g.float().pow(2).sum() for g in ref_grads.values()).sqrt()
    diff = sum((grads[n].float() - g.float()).pow(2).sum() for n, g in ref_grads.items()).sqrt()
    assert (diff / total).item() < 1e-2


@pytest.mark.parametrize("name", ["llama-sdpa", "gpt-neox"])
def test_same_families_as_in_fp32(name):
    """The report under autocast lists the same families and counts as the fp32 model's (rotary aside: q and k
    share a launch where both results are cast for attention, two otherwise)."""
    build, _ = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    counts = []
    for dtype in (None, torch.bfloat16):
        torch._dynamo.reset()
        tk_inductor.reset()
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            torch.compile(model, backend="thunderkittens", options=OPTS)(input_ids=ids)
        counts.append({f: n for f, n in _replaced(tk_inductor.report()).items() if f != "rotary"})
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("name", ["llama-sdpa", "deepseek-v3", "gpt-oss", "modernbert"])
def test_dynamic_true_replaces_every_family(name):
    build, expected = MODELS[name]
    torch.manual_seed(0)
    model = build().train()
    tk_inductor.reset()
    compiled = torch.compile(model, backend="thunderkittens", options=OPTS, dynamic=True)
    for length in (16, 24):
        ids = torch.randint(0, VOCAB, (2, length))
        logits, loss, grads = _step(model, compiled, ids, torch.bfloat16)
        ref_logits, ref_loss, ref_grads = _step(model, model, ids, torch.bfloat16)
        assert _rel(loss, ref_loss) < 1e-2
    replaced = _replaced(tk_inductor.report())
    assert set(expected) <= set(replaced), str(tk_inductor.report())
    assert len(tk_inductor.report().graphs) == 1  # a second length recompiles nothing


# ---------------------------------------------------------------------------- the pass itself

class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x, cos):
        q = self.lin(x)  # bf16 under autocast
        q2 = q * cos  # promoted: fp32
        with torch.autocast("cpu", enabled=False):
            off = q2 @ q2.transpose(-1, -2)  # fp32, autocast off
        return F.softmax(q2 @ q2.transpose(-1, -2), -1), off


def _graph(module, *args, dtype=torch.bfloat16):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.autocast("cpu", dtype=dtype):
        torch.compile(module, backend=capture)(*args)
    return graphs[0]


def test_casts_made_explicit_where_autocast_casts():
    gm = _graph(Branch(), torch.randn(4, 64), torch.randn(4, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        added = autocast.make_explicit(gm.graph)
    casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    # the two fp32 operands of the matmul under autocast (q2 and its transpose); none for the matmul inside the
    # disabled region, none for the linear (its inputs are fp32 parameters and x: autocast casts them, and so
    # does the pass)
    matmuls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "matmul"]
    inside, outside = matmuls
    assert not any(a in casts for a in inside.args) and all(a in casts for a in outside.args)
    assert added == len(casts) and all(c.args[1] == torch.bfloat16 for c in casts)


def test_explicit_graph_computes_what_autocast_computes():
    m = Branch()
    x, cos = torch.randn(4, 64), torch.randn(4, 64)
    tk_inductor.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = m(x, cos)
        got = torch.compile(m, backend="thunderkittens", options=OPTS)(x, cos)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)  # the same casts: bit-for-bit up to op order


def test_no_casts_without_autocast():
    gm = _graph(Branch(), torch.randn(4, 64), torch.randn(4, 64), dtype=torch.bfloat16)
    assert autocast.make_explicit(gm.graph, enabled={"cpu": False, "cuda": False}) == 0


class Norm(nn.Module):
    """LlamaRMSNorm as HF writes it, on an fp32 residual stream plus a bf16 branch, its output feeding a matmul."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(64))
        self.proj = nn.Linear(64, 64, bias=False)

    def forward(self, x, r):
        h = r + x
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.proj(self.weight * v.to(h.dtype)), h


def test_norm_under_autocast_takes_the_residual_and_the_cast(replaced_matches):
    torch.manual_seed(0)
    m = Norm()
    x, r = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    tk_inductor.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = m(x, r)
        got = torch.compile(m, backend="thunderkittens", options=OPTS)(x, r)
    (match,) = [s for s in replaced_matches if s.family == "layernorm"]
    xa, ra, wa = (rewrite.example(a) for a in match.args[:3])
    assert (xa.dtype, ra.dtype, wa.dtype) == (torch.bfloat16, torch.float32, torch.float32)  # x is the narrower
    assert match.args[9] == torch.bfloat16  # the cast in front of the matmul, fused
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    g = [torch.randn_like(t) for t in want]
    ga = torch.autograd.grad(got, (x, r, m.weight), g)
    gb = torch.autograd.grad(want, (x, r, m.weight), g)
    for a, b in zip(ga, gb):
        assert a.dtype == b.dtype
        assert _rel(a, b) < 1e-2


@pytest.mark.parametrize("inputs", ["padded", "packed"])
def test_run_time_masks_under_autocast(inputs):
    """A Llama on a left-padded batch or packed sequences under CPU autocast bf16: attention is replaced as in fp32
    (tk::attention_varlen), and loss, logits and gradients match eager autocast."""
    torch.manual_seed(0)
    model = _llama("sdpa").train()
    ids = torch.randint(0, VOCAB, (2, 24))
    if inputs == "padded":
        am = torch.ones(2, 24, dtype=torch.long)
        am[0, :7] = 0
        extra = {"attention_mask": am}
    else:
        extra = {"position_ids": torch.tensor([list(range(10)) + list(range(14)), list(range(24))])}

    def step(run):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = run(input_ids=ids, **extra).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    tk_inductor.reset()
    compiled = torch.compile(model, backend="thunderkittens", options=OPTS)
    ref_logits, ref_loss, ref_grads = step(model)
    logits, loss, grads = step(compiled)
    rep = tk_inductor.report()
    assert rep.replaced.get("attention") == 2, str(rep)
    assert _rel(loss, ref_loss) < 1e-2 and _rel(logits, ref_logits) < 1e-2
    total = sum(g.float().pow(2).sum() for g in ref_grads.values()).sqrt()
    diff = sum((grads[n].float() - g.float()).pow(2).sum() for n, g in ref_grads.items()).sqrt()
    assert (diff / total).item() < 1e-2
