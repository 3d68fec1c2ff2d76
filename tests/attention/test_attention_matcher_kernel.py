"""Attention family: the matcher in kernel mode (fake CUDA values: what the kernels take and what they leave), and
compiled HF models on the GPU with the kernels (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor.patterns import attention as P

from attention_helpers import OPTS, _check, _compile, _inputs, Fn, _kernel_built
from test_attention_matcher import PaddedLogits, _llama, _padded

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


@pytest.mark.parametrize("model", ["mistral", "gemma2", "gpt-oss"])
def test_hf_sliding_window_decode_steps_replaced(model):
    """generate() of sliding-window models with a dynamic cache and dynamic shapes: a decode step's window is bounded
    at the cache's symbolic length (Mistral, SDPA), and Gemma-2's sliding cache keeps the last window of keys, so its
    eager attention's additive mask bounds the keys at a symbolic offset. Each row is one run of keys, read at run
    time in inference (tk::attention_masked): every step's attention is replaced, and the tokens are eager's.
    gpt-oss adds its sinks: tk::attention_masked's o and lse, rescaled."""
    import transformers

    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=6)
    torch.manual_seed(0)
    if model == "mistral":
        net = transformers.MistralForCausalLM(transformers.MistralConfig(**common, attn_implementation="sdpa"))
    elif model == "gpt-oss":
        if not hasattr(transformers, "GptOssConfig") or tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 12):
            pytest.skip("gpt-oss needs transformers with it and torch >= 2.12 (torch 2.11 cannot trace its experts)")
        net = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, num_local_experts=2, num_experts_per_tok=1))
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

