"""Attention family: the matcher end to end in reference mode (every SDPA/eager spelling and HF model replaced and
equal to eager; the cases it must not replace kept with their reason), and kernel-mode checks on fake CUDA values."""
from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor import rewrite
from tk_inductor.config import Config
from tk_inductor.patterns import attention as P

from attention_helpers import OPTS, _compile, _kept, _inputs, Fn, repeat_kv, _eager, _kernel_built

# ============================================================================ the matcher, end to end (CPU, reference)

def _check(model, *inputs, replaced=1, grad=True, tol=1e-5, kept=0):
    """Compiled (reference mode) == eager, forward and gradients; the report says what was replaced."""
    inputs = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]
    ref_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = _compile(model)(*inputs)
    report = tk_inductor.report()
    ref = model(*ref_inputs)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert report.replaced.get("attention", 0) == replaced, str(report)
    assert len([r for f, r in report.kept if f == "attention"]) == kept, str(report)
    if grad:
        w = torch.randn_like(ref)
        params = [p for p in model.parameters() if p.requires_grad]
        got = torch.autograd.grad((out * w).sum(), [x for x in inputs if x.requires_grad] + params)
        model.zero_grad(set_to_none=True)
        want = torch.autograd.grad((ref * w).sum(), [x for x in ref_inputs if x.requires_grad] + params)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return report


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

def test_value_head_dim_differs_kept():
    q, k, _ = _inputs()
    v = torch.randn(2, 4, 8, 32)
    reasons = _kept(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), q, k, v)
    assert "value head dim" in reasons[0]


def test_not_replaced_outside_allowlist_or_reference():
    q, k, v = _inputs()
    fn = Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert "allowlist" in _kept(fn, q, k, v, options={**OPTS, "ops": ["rotary"]})[0]
    # without reference mode, CPU inputs have no kernel: kept for their device
    assert "device cpu" in _kept(fn, q, k, v, options={"inner": "aot_eager"})[0]


# ---------------------------------------------------------------------------- kernel-mode checks (fake CUDA values)

class QKV(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q, k, v)


def _fake_cuda_graph(fn, shapes, dtype):
    """fn traced to a torch-IR graph whose example values are fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = fx.symbolic_trace(QKV(fn))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    return gm


def _reasons(gm):
    return [m.reason for m in P.find(gm.graph)]


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def eager_causal(q, k, v):
    N = q.shape[-2]
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.125
    s = s.masked_fill(q.new_ones(N, N, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), v)


@pytest.mark.parametrize("fn", [sdpa_causal, eager_causal])
def test_kernel_mode_supported(fn):
    gm = _fake_cuda_graph(fn, [(2, 8, 32, 128), (2, 2, 32, 128), (2, 2, 32, 128)] if fn is sdpa_causal
                          else [(2, 8, 32, 64)] * 3, torch.bfloat16)
    (m,) = P.find(gm.graph)
    assert m.reason is None and m.device.type == "cuda" and not m.needs_grad
    assert m.target is torch.ops.tk.attention.default and m.args[3] is True


@pytest.mark.parametrize("fn", [sdpa_causal, eager_causal])
@pytest.mark.parametrize("dtype, D, why", [(torch.float32, 64, "dtype torch.float32"),
                                           (torch.bfloat16, 112, "head dim 112")])
def test_kernel_mode_unsupported_dtype_or_head_dim(fn, dtype, D, why):
    gm = _fake_cuda_graph(fn, [(2, 4, 32, D)] * 3, dtype)
    (reason,) = _reasons(gm)
    assert reason is not None and why in reason
    with tk_inductor.config.patch(reference=True):  # reference mode: the op's reference takes any of these
        assert _reasons(gm) == [None]


@pytest.mark.parametrize("fn", [sdpa_causal, eager_causal])
@pytest.mark.parametrize("D", [192, 256])
def test_kernel_mode_wide_head_dims(fn, D):
    """Head dims 192/256 (Gemma) are replaced in inference and in training; 320 is kept with the reason."""
    for d, want in ((D, None), (320, "head dim 320")):
        gm = _fake_cuda_graph(fn, [(2, 4, 32, d)] * 3, torch.bfloat16)
        for training in (False, True):
            for n in gm.graph.nodes:
                if n.op == "placeholder":
                    n.meta["val"].requires_grad_(training)
            (reason,) = _reasons(gm)
            assert reason == want if want is None else want in reason


def sdpa_full(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def sdpa_repeated(q, k, v):  # HF's sdpa path with a mask: K/V repeated per query head (repeat_kv), 8 : 2 heads
    return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))


@pytest.mark.parametrize("fn", [sdpa_full, sdpa_repeated])
@pytest.mark.parametrize("N", [1, 16, 17])
def test_kernel_mode_decode_steps(N, fn):
    """A decode step (at most 16 queries against a long cache) on SDPA's grouped-query path without a mask stays with
    SDPA in kernel mode (its split-KV kernels are as fast); on repeated K/V it is replaced (the split-KV decode
    kernels read each K/V head once). Reference mode replaces both."""
    gm = _fake_cuda_graph(fn, [(2, 8, N, 128), (2, 2, 4096, 128), (2, 2, 4096, 128)], torch.bfloat16)
    (reason,) = _reasons(gm)
    kept = fn is sdpa_full and N <= 16
    assert (reason is not None and "decode step" in reason) if kept else reason is None
    with tk_inductor.config.patch(reference=True):
        assert _reasons(gm) == [None]


def test_heads_not_a_multiple_kept():
    """Eager code cannot produce Hq % Hkv != 0 (SDPA raises), so feed the matcher such example values."""
    gm = _fake_cuda_graph(sdpa_causal, [(2, 4, 32, 64), (2, 2, 32, 64), (2, 2, 32, 64)], torch.bfloat16)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mode = placeholders[0].meta["val"].fake_mode
    with mode:
        for n in placeholders[1:]:
            n.meta["val"] = torch.empty(2, 3, 32, 64, dtype=torch.bfloat16, device="cuda")
    (reason,) = _reasons(gm)
    assert "not a multiple" in reason


@pytest.mark.parametrize("grad", [False, True])
def test_needs_grad_and_device_from_example_values(grad):
    seen = []

    def backend(gm, example_inputs):
        seen.extend(P.find(gm.graph))
        return gm

    torch._dynamo.reset()
    q, k, v = (t.requires_grad_(grad) for t in _inputs())
    torch.compile(Fn(sdpa_causal), backend=backend)(q, k, v)
    (m,) = seen
    assert m.needs_grad is grad and m.device == torch.device("cpu") and m.reason is None


# ============================================================================ on the GPU (skipped without CUDA)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpu_llama_bf16_kernel_replaced(impl):
    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).cuda().bfloat16()
    ids = torch.randint(0, 128, (2, 77), device="cuda")
    compiled = _compile(model, {"inner": "aot_eager", "ops": ["attention"]})
    got = compiled(ids).logits
    report = tk_inductor.report()
    want = model(ids).logits
    assert report.replaced.get("attention") == 2, str(report)
    assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2
    got.float().square().mean().backward()  # the backward kernel runs inside autograd
    assert all(p.grad is not None and not p.grad.isnan().any() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_per_layer_compile(impl):
    """torch.compile per decoder layer (as torchtitan/FSDP2 users do): each layer's graph receives the mask built
    outside it, so it is checked at run time; the model equals eager, forward and gradients."""
    model = _llama(impl).eval()
    ids = torch.randint(0, 64, (2, 9))
    want = model(ids).logits
    tk_inductor.reset()
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend="thunderkittens", options=OPTS)
    got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    report = tk_inductor.report()
    assert report.replaced.get("attention", 0) >= 1 and not [r for f, r in report.kept if f == "attention"], str(report)


def test_hf_llama_padding_mask_dynamic_shapes():
    """dynamic=True: symbolic lengths still prove the padding mask's reads; two lengths, one compile each way."""
    model = PaddedLogits(_llama("sdpa")).eval()
    compiled = torch.compile(model, backend="thunderkittens", options=OPTS, dynamic=True)
    for N in (9, 13):
        ids, am = _padded(2, N, [("left", 3), ("right", 2)])
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, am), model(ids, am), rtol=1e-5, atol=1e-5)
        assert tk_inductor.report().replaced.get("attention", 0) == 2, str(tk_inductor.report())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("inputs", ["attention_mask", "position_ids"])
def test_hf_mistral_window_with_run_time_masks(impl, inputs):
    """A sliding window (3) together with a left-padding mask or packed sequences (HF evaluates the window on the
    position ids there): swapped with both, equal to eager, gradients included."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=3, attn_implementation=impl)
    torch.manual_seed(0)
    model = PaddedLogits(MistralForCausalLM(cfg), inputs).train()
    if inputs == "position_ids":
        x = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4], list(range(11))])
    else:
        x = torch.ones(2, 11, dtype=torch.long)
        x[0, :4] = 0
    _check(model, torch.randint(0, 64, (2, 11)), x, replaced=2)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hf_llama_generate_left_padded(cache):
    """generate() on a left-padded batch with a compiled forward gives eager's tokens; the prefill's attention is
    replaced (tk::attention_varlen) with a dynamic cache. With a static cache every step writes the new keys into the
    buffer in place before attention reads it, and attention is replaced (the mask is a run-time input:
    tk::attention_masked)."""
    model = _llama("sdpa", cache=True).eval()
    ids = torch.randint(1, 64, (2, 7))
    am = torch.ones(2, 7, dtype=torch.long)
    am[0, :3] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = model.generate(ids, attention_mask=am, **kw)
    model.forward = torch.compile(model.forward, backend="thunderkittens", options=OPTS)
    got = model.generate(ids, attention_mask=am, **kw)
    assert torch.equal(got, want)
    replaced = tk_inductor.report().replaced.get("attention", 0)
    assert replaced >= 2, str(tk_inductor.report())


def _generate_replaces_every_step(ids, min_graphs: int, model=None, **kw) -> None:
    """generate() with a compiled forward (dynamic shapes) gives eager's tokens, and every graph it compiles
    replaces both layers' attention (of a small Llama unless `model` is given)."""
    model = model or _llama("sdpa", cache=True).eval()
    want = model.generate(ids, **kw)
    tk_inductor.reset()
    model.forward = torch.compile(model.forward, backend="thunderkittens", options=OPTS, dynamic=True)
    got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    graphs = tk_inductor.report().graphs
    assert len(graphs) >= min_graphs and all(g.replaced.get("attention", 0) == 2 and not g.kept for g in graphs), graphs


@pytest.mark.parametrize("padded", [False, True])
def test_hf_llama_generate_decode_steps_replaced(padded):
    """generate() with dynamic shapes: the decode steps' attention is replaced too. Their mask reads the query
    positions at the cache's symbolic length (kv <= past + q, every cached key for one query) and, padded, the
    padding mask, whose columns are another symbol; the two caches' lengths are separate symbols as well."""
    am = torch.ones(2, 7, dtype=torch.long)
    if padded:
        am[0, :3] = 0
    _generate_replaces_every_step(torch.randint(1, 64, (2, 7)), 2, attention_mask=am, max_new_tokens=5,
                                  do_sample=False, pad_token_id=0)


def test_hf_llama_prompt_lookup_decoding():
    """generate() with prompt-lookup decoding (several candidate tokens checked per step against the cache) and
    dynamic shapes: the steps' causal mask is aligned to the end of the cache, at a symbolic offset; in inference its
    values are read at run time (tk::attention_masked: one run of keys per row), so every step's attention is
    replaced, and the tokens are eager's."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])  # repeats: the lookup finds candidates
    _generate_replaces_every_step(ids, 3, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("model", ["mistral", "gemma2"])
def test_hf_sliding_window_decode_steps_replaced(model):
    """generate() of sliding-window models with a dynamic cache and dynamic shapes: a decode step's window is bounded
    at the cache's symbolic length (Mistral, SDPA), and Gemma-2's sliding cache keeps the last window of keys, so its
    eager attention's additive mask bounds the keys at a symbolic offset. Each row is one run of keys, read at run
    time in inference (tk::attention_masked): every step's attention is replaced, and the tokens are eager's."""
    import transformers

    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=6)
    torch.manual_seed(0)
    if model == "mistral":
        net = transformers.MistralForCausalLM(transformers.MistralConfig(**common, attn_implementation="sdpa"))
    else:
        net = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
            attn_implementation="eager"))
    _generate_replaces_every_step(torch.randint(1, 64, (2, 9)), 2, model=net.eval(), max_new_tokens=6,
                                  do_sample=False, pad_token_id=0)


def test_symbolic_scale_and_softcap_are_specialised():
    """dynamic=True passes a module's float attributes (a scaling, Gemma-2's softcap) as symbolic floats: the
    replacement takes their values as constants, guarded, so new values recompile and stay eager's."""

    class Capped(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.cap = 0.1, 5.0

        def forward(self, q, k, v):
            s = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * self.scale / self.cap) * self.cap
            return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), v)

    model = Capped()
    compiled = torch.compile(model, backend="thunderkittens", options=OPTS, dynamic=True)
    q, k, v = (torch.randn(2, 4, 16, 32) for _ in range(3))
    for scale, cap in ((0.1, 5.0), (0.3, 5.0), (0.3, 2.0)):
        model.scale, model.cap = scale, cap
        tk_inductor.reset()
        got = compiled(q, k, v)
        torch.testing.assert_close(got, model(q, k, v))
        assert tk_inductor.report().replaced.get("attention", 0) == 1, str(tk_inductor.report())
