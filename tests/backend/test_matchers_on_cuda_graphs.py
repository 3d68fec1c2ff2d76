"""The matchers' CUDA branches on a CPU machine: graphs captured by Dynamo on the CPU get fake CUDA example values
(FakeTensorMode makes them without a GPU), and every family's `find` runs on them with reference mode off, as it
does on the device. The kernel-support checks live only in those branches; a bug there (a NameError once made the
linear-attention rewrite pass every CUDA graph through) shows here instead of in the first GPU run."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.fx as fx

from tk_inductor import config

from dynamo_tracing import to_fake_cuda

from models_linear import TinyLM

transformers = pytest.importorskip("transformers")

FAMILIES = ("attention", "linear_attention", "ssd", "layernorm", "rotary")


def _capture(module: torch.nn.Module, *inputs) -> list[fx.GraphModule]:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(module, backend=backend)(*inputs)
    return graphs


def _matches_on_cuda(graphs) -> dict[str, list]:
    cfg = config.current({"reference": False})
    found = {family: [] for family in FAMILIES}
    for gm in graphs:
        to_fake_cuda(gm.graph)
        for family in FAMILIES:
            matcher = importlib.import_module(f"tk_inductor.patterns.{family}")
            found[family] += list(matcher.find(gm.graph, cfg))
    return found


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   max_position_embeddings=128, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).bfloat16()


def _mamba2():
    cfg = transformers.Mamba2Config(vocab_size=96, hidden_size=128, num_heads=4, head_dim=64, state_size=64,
                                    n_groups=1, expand=2, num_hidden_layers=1, chunk_size=64, conv_kernel=4)
    return transformers.Mamba2ForCausalLM(cfg).bfloat16()


def _modernbert():  # global attention and a two-sided window (interval tables: tk::attention_varlen)
    cfg = transformers.ModernBertConfig(vocab_size=96, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2,
                                        local_attention=32, max_position_embeddings=256)
    return transformers.ModernBertModel(cfg).bfloat16()


def _deepseek_v3():  # multi-head latent attention: q/k head dim 96 (64 + 32 rotary), v head dim 64
    cfg = transformers.DeepseekV3Config(vocab_size=96, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2, intermediate_size=256, moe_intermediate_size=64,
                                        n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
                                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=32,
                                        qk_nope_head_dim=64, v_head_dim=64, n_group=1, topk_group=1,
                                        max_position_embeddings=256)
    return transformers.DeepseekV3ForCausalLM(cfg).bfloat16()


def _gpt_oss():  # attention sinks, a sliding window on alternate layers
    cfg = transformers.GptOssConfig(vocab_size=96, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=64, intermediate_size=256, num_local_experts=2,
                                    num_experts_per_tok=1, sliding_window=32, max_position_embeddings=256)
    return transformers.GptOssForCausalLM(cfg).bfloat16()


def test_pixtral_image_blocks_on_cuda():
    """Pixtral's images packed in one sequence (a block mask written in place) go to tk::attention_varlen in kernel
    mode: static packed-sequence ids, head dim 64. (transformers 5.17 slices the blocks with tensor bounds, which
    Dynamo splits off: the mask arrives as a graph input, for tk::attention_masked to read at run time.)"""
    cfg = transformers.PixtralVisionConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=64, patch_size=16, head_dim=64,
                                           attn_implementation="sdpa")
    model = transformers.PixtralVisionModel(cfg).bfloat16()
    imgs, sizes = torch.randn(3, 3, 64, 64, dtype=torch.bfloat16), torch.tensor([[64, 32], [32, 64], [48, 48]])
    with torch.no_grad():
        found = _matches_on_cuda(_capture(model, imgs, sizes))
    assert [m.reason for m in found["attention"]] == [None], [m.reason for m in found["attention"]]
    match = found["attention"][0]
    if match.target is not torch.ops.tk.attention_masked.default:
        assert match.args[-1] == (8, 8, 9)  # the images' patch counts


def _tiny(config: str, model: str):  # Cohere, ERNIE 4.5, HunYuan: their norm and rotary spellings (test_models)
    def build():
        if not hasattr(transformers, config):
            pytest.skip(f"transformers {transformers.__version__} has no {config}")
        cfg = getattr(transformers, config)(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=64, pad_token_id=0,
                                            max_position_embeddings=128, attn_implementation="sdpa")
        return getattr(transformers, model)(cfg).bfloat16()
    return build


@pytest.mark.parametrize("name, model, families", [
    ("llama", _llama, {"attention", "rotary", "layernorm"}),
    ("mamba2", _mamba2, {"ssd", "layernorm"}),
    ("based", lambda: TinyLM(vocab=64, d_model=64, layers=1, heads=2, feature_dim=16, head_dim=64,
                             feature_map="based", form="based").bfloat16(), {"linear_attention"}),
    ("modernbert", _modernbert, {"attention", "layernorm"}),
    ("deepseek-v3", _deepseek_v3, {"layernorm"}),  # MLA under SDPA stays with cuDNN
    ("gpt-oss", _gpt_oss, {"attention", "rotary", "layernorm"}),
    ("cohere", _tiny("CohereConfig", "CohereForCausalLM"), {"attention", "rotary", "layernorm"}),
    ("ernie4_5", _tiny("Ernie4_5Config", "Ernie4_5ForCausalLM"), {"attention", "rotary", "layernorm"}),
    ("hunyuan", _tiny("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM"), {"attention", "rotary", "layernorm"}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_matchers_run_their_cuda_branches(name, model, families):
    if not hasattr(transformers, {"modernbert": "ModernBertConfig", "deepseek-v3": "DeepseekV3Config",
                                  "gpt-oss": "GptOssConfig"}.get(name, "AutoConfig")):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    with torch.no_grad():
        found = _matches_on_cuda(_capture(model(), torch.randint(0, 64, (1, 128))))
    for family in families:
        assert found[family], f"{name}: no {family} match"
        # the kernel checks ran: each match is replaced, or kept for a reason those checks give
        for m in found[family]:
            assert m.reason is None or isinstance(m.reason, str), (family, m.reason)
    replaced = {family for family, ms in found.items() if any(m.reason is None for m in ms)}
    assert families <= replaced, {f: [m.reason for m in found[f]] for f in families}
    if name in ("modernbert", "gpt-oss"):  # every layer: a two-sided window, sinks
        assert all(m.reason is None for m in found["attention"]), [m.reason for m in found["attention"]]
