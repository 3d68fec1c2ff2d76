"""Attention family: the matcher end to end in reference mode (every SDPA/eager spelling and HF model replaced and
equal to eager; the cases it must not replace kept with their reason). Kernel mode: test_attention_matcher_kernel.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor import rewrite
from tk_inductor.config import Config
from tk_inductor.patterns import attention as P

from attention_helpers import OPTS, _check, _compile, _kept, _inputs, Fn, repeat_kv, _eager

# ============================================================================ the matcher, end to end (CPU, reference)



# ---------------------------------------------------------------------------- SDPA spellings

@pytest.mark.parametrize("N, M", [(8, 8), (8, 5), (5, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(N, M, causal):
    _check(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), *_inputs(N=N, M=M))


def test_sdpa_scale_gqa_dropout0():
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True, scale=0.3,
                                                        enable_gqa=True)
    _check(Fn(fn), *_inputs(Hq=8, Hkv=2))


def test_sdpa_after_repeat_kv():
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)
    _check(Fn(fn), *_inputs(Hq=8, Hkv=2))


def test_sdpa_three_d():
    _check(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
           *(t[:, 0] for t in _inputs(N=6, M=9)))


def test_sdpa_with_in_graph_causal_masks():
    def bool_mask(q, k, v):
        N, M = q.shape[-2], k.shape[-2]
        mask = torch.ones(N, M, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def float_mask(q, k, v):
        N, M = q.shape[-2], k.shape[-2]
        mask = torch.full((N, M), float("-inf"), device=q.device).triu(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    _check(Fn(bool_mask), *_inputs(N=8, M=11))
    _check(Fn(float_mask), *_inputs(N=11, M=8))


# ---------------------------------------------------------------------------- eager spellings

@pytest.mark.parametrize("product", ["matmul", "at", "mT", "permute", "bmm", "einsum"])
def test_eager_products(product):
    _check(Fn(_eager(product=product)), *_inputs(N=8, M=6))


@pytest.mark.parametrize("scale", ["mul_scores", "div_scores", "q_mul", "div_after_mask"])
def test_eager_scales(scale):
    _check(Fn(_eager(scale=scale)), *_inputs(N=6, M=8))


@pytest.mark.parametrize("mask", ["masked_fill_tril", "masked_fill_triu_finfo", "ones_tril_eq0", "where_arange",
                                  "where_arange_gt", "additive_triu", "additive_where", "all_visible", "twice",
                                  "none"])
@pytest.mark.parametrize("N, M", [(9, 5), (5, 9)])
def test_eager_masks(mask, N, M):
    _check(Fn(_eager(mask=mask)), *_inputs(N=N, M=M))


@pytest.mark.parametrize("softmax", ["f", "f_fp32", "torch", "method_upcast"])
def test_eager_softmax(softmax):
    _check(Fn(_eager(softmax=softmax)), *_inputs())


@pytest.mark.parametrize("dropout", [(0.0, True), (0.3, False)])
def test_eager_dropout_inactive(dropout):
    _check(Fn(_eager(dropout=dropout)), *_inputs())


@pytest.mark.parametrize("product", ["matmul", "bmm"])
def test_eager_repeat_kv_dropped(product):
    # the bmm spelling cannot reshape repeated heads back; plain matmul GQA is replaced with Hkv < Hq
    _check(Fn(_eager(product=product, gqa=4)), *_inputs(Hq=8, Hkv=2))


def test_repeat_kv_is_really_dropped():
    """The op reads the un-repeated k/v: no expand/reshape of k/v survives in the rewritten graph."""
    seen = {}

    def backend(gm, example_inputs):
        rewrite.run(gm, Config(reference=True))
        seen["targets"] = [n.target for n in gm.graph.nodes]
        seen["args"] = [n.args for n in gm.graph.nodes if n.target is torch.ops.tk.attention.default]
        return gm

    q, k, v = _inputs(Hq=8, Hkv=2)
    torch._dynamo.reset()
    out = torch.compile(Fn(_eager(gqa=4)), backend=backend)(q, k, v)
    torch.testing.assert_close(out, _eager(gqa=4)(q, k, v), rtol=1e-5, atol=1e-5)
    assert torch.ops.tk.attention.default in seen["targets"]
    (args,) = seen["args"]
    assert args[1].op == "placeholder" and args[2].op == "placeholder" and args[3] is True
    assert "expand" not in seen["targets"] and "softmax" not in seen["targets"]


def test_pretransposed_key_and_three_d_bmm():
    """Adapter paths: k arrives already transposed (GPT-2 legacy permute), and plain 3-D bmm attention."""

    def legacy(q, k, v):  # q, k, v as (B, N, H, D)
        kt = k.permute(0, 2, 3, 1)  # (B, H, D, M)
        s = torch.matmul(q.permute(0, 2, 1, 3), kt) / math.sqrt(q.shape[-1])
        p = s.softmax(-1)
        return torch.matmul(p, v.permute(0, 2, 1, 3))

    def single_head(q, k, v):  # (B, N, D)
        s = torch.bmm(q, k.transpose(1, 2)) * 0.25
        return torch.bmm(torch.softmax(s, dim=-1), v)

    q, k, v = (t.transpose(1, 2).contiguous() for t in _inputs(N=7, M=7))
    _check(Fn(legacy), q, k, v)
    q, k, v = (t[:, 0] for t in _inputs(N=7, M=5))
    _check(Fn(single_head), q, k, v)


def test_causal_flag_follows_the_mask():
    """The op gets causal=True exactly when the mask is causal (an all-visible mask gives False)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(m.args[3] for m in P.find(gm.graph) if m.reason is None)
        return gm

    for mask, causal in [("all_visible", False), ("none", False), ("twice", True), ("where_arange", True)]:
        seen.clear()
        torch._dynamo.reset()
        torch.compile(Fn(_eager(mask=mask)), backend=backend)(*_inputs(N=6, M=6))
        assert seen == [causal], mask


def test_causal_then_padding_mask_kept():
    def fn(q, k, v, pad):  # every mask applied must be provable, not only the first
        N = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * 0.25
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
        s = s + pad
        return s.softmax(-1) @ v

    pad = torch.zeros(2, 1, 1, 8)
    pad[0, ..., 5:] = float("-inf")
    assert "graph input" in _kept(Fn(fn), *_inputs(), pad)[0]


def test_merged_heads_output_used_directly():
    def fn(q, k, v):
        B, H, N, D = q.shape
        s = torch.bmm(q.reshape(B * H, N, D), k.reshape(B * H, -1, D).transpose(1, 2))
        p = torch.softmax(s * D ** -0.5, -1)
        return torch.bmm(p, v.reshape(B * H, -1, D)) + 1.0  # (B*H, N, D) consumed as is

    _check(Fn(fn), *_inputs(N=7, M=9))


def test_output_viewed_after_attention():
    """A `.view` of the eager (contiguous) result must keep working on the op's (B, N, H, D)-major output."""

    def fn(q, k, v):
        B, H, N, D = q.shape
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).view(B * H, N, D)

    _check(Fn(fn), *_inputs())


def test_dynamic_shapes():
    fn = Fn(_eager(mask="where_arange"))
    q, k, v = _inputs(N=8, M=8)
    torch._dynamo.mark_dynamic(q, 2)
    torch._dynamo.mark_dynamic(k, 2)
    torch._dynamo.mark_dynamic(v, 2)
    _check(fn, q, k, v)


# ---------------------------------------------------------------------------- HF transformers models

def _llama(impl, layers=2, heads=4, kv_heads=2, cache=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation=impl,
                      use_cache=cache)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class Logits(nn.Module):
    def __init__(self, model, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, ids, *extra):
        out = self.model(ids, *extra, **self.kwargs)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_training(impl):
    model = Logits(_llama(impl)).train()
    ids = torch.randint(0, 64, (2, 9))
    _check(model, ids, replaced=2, grad=True)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_inference_with_cache(impl):
    model = Logits(_llama(impl, cache=True)).eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        _check(model, ids, replaced=2, grad=False)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_decode_step(impl):
    """Prefill, then one token against the cache: q_len 1 sees every cached key (non-causal, N != M)."""
    model = _llama(impl, cache=True).eval()
    compiled = _compile(model)
    ids, nxt = torch.randint(0, 64, (2, 9)), torch.randint(0, 64, (2, 1))
    with torch.no_grad():
        got, want = compiled(ids, use_cache=True), model(ids, use_cache=True)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        got = compiled(nxt, past_key_values=got.past_key_values, use_cache=True)
        want = model(nxt, past_key_values=want.past_key_values, use_cache=True)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert tk_inductor.report().replaced["attention"] == 4, str(tk_inductor.report())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_gpt2(impl):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=32, attn_implementation=impl,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = Logits(GPT2LMHeadModel(cfg)).train()
    _check(model, torch.randint(0, 64, (2, 10)), replaced=2, grad=True)


def test_hf_gpt2_reorder_and_upcast_attn():
    """GPT-2's Megatron path: baddbmm(beta=0, alpha=scale) scores in 3-D, viewed to 4-D, 4-D value product."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=32, attn_implementation="eager",
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, reorder_and_upcast_attn=True, scale_attn_by_inverse_layer_idx=True)
    torch.manual_seed(0)
    model = Logits(GPT2LMHeadModel(cfg)).train()
    _check(model, torch.randint(0, 64, (2, 10)), replaced=2, grad=True)


def test_hf_bloom_alibi_kept_with_its_reason():
    """BLOOM's scores are `alibi.baddbmm(q, kᵀ, beta=1, alpha=scale)`: ALiBi position biases added to the scores,
    which the kernels do not add. Kept, and the report says so."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=64, n_layer=2, n_head=4)).eval()
    reasons = _kept(Fn(lambda i: model(i).logits), torch.randint(0, 64, (2, 9)))
    assert len(reasons) == 2 and all("ALiBi" in r for r in reasons), reasons


def test_scores_viewed_to_other_heads_kept():
    def fn(q, k, v):  # 3-D scores viewed to (H, B) while q was (B, H): not the same pairing
        B, H, N, D = q.shape
        s = torch.bmm(q.reshape(B * H, N, D), k.reshape(B * H, N, D).transpose(1, 2)).view(H, B, N, N)
        return torch.matmul(s.softmax(-1), v)

    q, k, v = _inputs(B=2, Hq=4, Hkv=4)
    v = torch.randn(4, 2, 8, 16)
    reason = _kept(Fn(fn), q, k, v)[0]
    assert "differ from q's" in reason or "batch is broadcast" in reason, reason


def _bert(impl):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, attn_implementation=impl, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertModel(cfg).eval()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_bert_without_padding_is_full_attention(impl):
    _check(Logits(_bert(impl)), torch.randint(0, 64, (2, 10)), replaced=2, grad=False)


def _padded(B, N, pads):
    """(ids, attention_mask) with entry b's padding: ("right", n) or ("left", n) zeros, or ("holes", n)."""
    ids = torch.randint(0, 64, (B, N))
    am = torch.ones(B, N, dtype=torch.long)
    for b, (side, n) in enumerate(pads):
        if side == "right" and n:
            am[b, N - n:] = 0
        elif side == "left" and n:
            am[b, :n] = 0
        elif side == "holes":
            am[b, 1:1 + n] = 0
    return ids, am


class PaddedLogits(nn.Module):
    """Logits with a run-time mask input as a graph input: the ids and the model's `key` argument (the padding mask
    by default, or position ids) both forward arguments."""

    def __init__(self, model, key="attention_mask"):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, ids, x):
        out = self.model(input_ids=ids, **{self.key: x})
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("pads", [[("right", 3), ("right", 0)], [("holes", 2), ("right", 9)], [("right", 10)]])
def test_hf_bert_padding_mask(impl, pads):
    """BERT under a key-padding mask: swapped (tk::attention_varlen) and equal to eager, gradients included; an
    entry with holes, or without any token (eager's finite fill averages v there), takes the reference."""
    ids, am = _padded(2, 10, pads)
    model = PaddedLogits(_bert(impl))
    out = _compile(model)(ids, am)
    report = tk_inductor.report()
    assert report.replaced.get("attention", 0) == 2, str(report)
    torch.testing.assert_close(out, model(ids, am), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_hf_llama_padding_mask(impl, side):
    """Llama (causal) under left or right padding: swapped, equal to eager at every position (left padding's rows
    without keys: 0 under SDPA, eager's average of v under its finite fill), gradients included."""
    _check(PaddedLogits(_llama(impl)).train(), *_padded(2, 9, [(side, 3), (side, 0)]), replaced=2)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_packed_sequences(impl):
    """Packed sequences (position ids that restart at each sequence, as DataCollatorWithFlattening gives): HF builds
    the mask from the ids at run time; swapped (tk::attention_varlen with the sequence ids) and equal to eager,
    gradients included."""
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    _check(PaddedLogits(_llama(impl), "position_ids").train(), torch.randint(0, 64, (2, 11)), pos, replaced=2)


def test_hf_output_attentions_kept():
    model = _llama("eager").eval()
    reasons = _kept(Fn(lambda i: model(i, output_attentions=True).logits), torch.randint(0, 64, (2, 9)))
    assert all("used elsewhere" in r for r in reasons), reasons


# ---------------------------------------------------------------------------- must not replace

def test_value_head_dim_differs():
    """Replaced (the kernels run q/k and v zero-padded to one head dim: test_attention_value_dim.py), except under a
    mask known only at run time, whose ops take one head dim."""
    q, k, _ = _inputs()
    v = torch.randn(2, 4, 8, 32)
    _check(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), q, k, v)
    mask = torch.rand(8, 8) > 0.3
    mask[:, 0] = True
    reasons = _kept(Fn(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)), q, k, v, mask)
    assert "value head dim 32 differs from the query/key head dim 16 under a mask known only at run time" in reasons[0]


def test_not_replaced_outside_allowlist_or_reference():
    q, k, v = _inputs()
    fn = Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert "allowlist" in _kept(fn, q, k, v, options={**OPTS, "ops": ["rotary"]})[0]
    # without reference mode, CPU inputs have no kernel: kept for their device
    assert "device cpu" in _kept(fn, q, k, v, options={"inner": "aot_eager"})[0]
