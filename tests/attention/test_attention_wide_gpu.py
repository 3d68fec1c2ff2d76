"""GPU tests of the kernels for head dims above 128 (the D = 192 and 256 forward kernels and the D = 256 backward,
zero-filled past the head dim: Gemma's 256, 192): prefill and decode shapes, causal, full, sliding window, softcap,
scales <= 0 (folded into q), padding and packed sequences through tk::attention_varlen, forward and backward,
against the fp32 reference; a value head dim other than q/k's (MLA) through tk::attention. Skipped without CUDA.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import tk_inductor.ops.attention as A  # registers the tk:: ops
from test_attention_gpu import GRAD_TOL, OUT_TOL, check_forward, make_inputs, ops, poison, reference, rel_err  # noqa: F401
from test_attention_varlen_gpu import keep_of, segments_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cases():
    out = []
    # tails of the 48-key and 128-row tiles, N != M, GQA, both dtypes and layouts
    lengths = ((1000, 1000), (17, 17), (129, 300), (300, 129), (4096, 4096), (200, 4097))
    for i, ((N, M), scores) in enumerate(itertools.product(lengths, ("full", "causal", "window", "cap"))):
        D = (256, 192, 136, 248)[i % 4]
        dtype = (torch.bfloat16, torch.float16)[(i // 2) % 2]
        heads = ((4, 4), (8, 2), (8, 4))[i % 3]
        out.append(((1, 2)[i % 2], *heads, N, M, D, dtype, scores, ("bhnd", "bnhd")[(i // 3) % 2]))
    # decode shapes (the split-KV kernels): one to sixteen rows, one and many splits, every row-tile count
    for i, (N, M) in enumerate(itertools.product((1, 3, 16), (1, 1000, 33000))):
        heads = ((8, 4), (16, 1), (32, 8))[i % 3]
        out.append(((1, 3)[i % 2], *heads, N, M, (256, 192)[i % 2], (torch.bfloat16, torch.float16)[i % 2],
                    ("full", "causal", "window", "cap")[i % 4], ("bhnd", "bnhd")[(i // 2) % 2]))
    return out


def _id(c):
    B, Hq, Hkv, N, M, D, dtype, scores, layout = c
    return f"B{B}-H{Hq}:{Hkv}-N{N}-M{M}-D{D}-{str(dtype)[6:]}-{scores}-{layout}"


def _scores(kind, D, M):
    causal = kind in ("causal", "window")
    window = max(1, M // 3) if kind == "window" else 0
    return causal, window, (30.0 if kind == "cap" else 0.0), 1.0 / math.sqrt(D)


@pytest.mark.parametrize("case", cases(), ids=_id)
def test_forward(ops, case):
    B, Hq, Hkv, N, M, D, dtype, kind, layout = case
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, dtype, layout=layout, seed=N + M + D)
    causal, window, cap, scale = _scores(kind, D, M)
    check_forward(ops, q, k, v, causal, scale, window, cap)  # rows past a window's reach see no key


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [256, 232])
def test_scale_folded_into_q(ops, causal, D):
    """scale <= 0: the binding folds it into q for the ping-pong kernels (at D = 256 O is stored from registers, at
    232 only the columns below D)."""
    q, k, v = make_inputs(2, 4, 2, 777, 777, D, torch.bfloat16, layout="bnhd", seed=5)
    o, lse = ops.attention(q, k, v, causal, -0.05)
    o_ref, lse_ref = reference(q, k, v, causal, -0.05)
    assert rel_err(o, o_ref) < OUT_TOL
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("N", [1, 700])
def test_padding_masks(ops, N):
    """Key-padding masks through tk::attention_varlen: interval tables on the D = 256 kernels (prefill and decode)."""
    B, Hq, Hkv, M, D = 3, 8, 4, 700, 256
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, torch.bfloat16, seed=11)
    keep = keep_of(B, M, seed=N + 1)
    o, _ = torch.ops.tk.attention_varlen(q, k, v, keep, None, N == M, 1 / 16)
    o_ref, _ = reference(q, k, v, N == M, 1 / 16, keep=keep)
    assert rel_err(o, o_ref) < OUT_TOL


def backward_cases():
    out = []
    # one and several 64-key blocks and 64-row q tiles with their tails, N != M both ways, GQA, both dtypes
    lengths = ((1, 1), (17, 17), (65, 65), (1000, 1000), (129, 300), (300, 129), (2048, 2048), (64, 4100))
    for i, ((N, M), scores) in enumerate(itertools.product(lengths, ("full", "causal", "window", "cap"))):
        D = (256, 192, 136, 248)[i % 4]
        dtype = (torch.bfloat16, torch.float16)[(i // 2) % 2]
        heads = ((4, 4), (8, 2), (6, 1))[i % 3]
        out.append(((1, 2)[i % 2], *heads, N, M, D, dtype, scores, ("bhnd", "bnhd")[(i // 3) % 2]))
    return out


@pytest.mark.parametrize("case", backward_cases(), ids=_id)
def test_backward(ops, case):
    from tk_inductor.ops.attention import grad_like

    B, Hq, Hkv, N, M, D, dtype, kind, layout = case
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, dtype, layout=layout, seed=N + M + D + 1)
    causal, window, cap, scale = _scores(kind, D, M)
    if window and N > M:
        window = 0  # rows past the window's reach would see no key
    do = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    o, lse = ops.attention(q, k, v, causal, scale, window, cap)
    poison(((B, Hq, N, D), dtype), ((B, Hkv, M, D), dtype), ((B, Hkv, M, D), dtype))
    dq, dk, dv = ops.attention_backward(do, q, k, v, o, lse, causal, scale, window, cap)
    torch.cuda.synchronize()
    for t, like in ((dq, q), (dk, k), (dv, v)):
        assert t.shape == like.shape and t.dtype == dtype and t.stride() == grad_like(like).stride()
        assert not torch.isnan(t).any()
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference(qr, kr, vr, causal, scale, window, cap)
    o_ref.backward(do.float())
    for name, got, ref in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert rel_err(got, ref) < GRAD_TOL, f"{name}: relative error {rel_err(got, ref):.3e}"


@pytest.mark.parametrize("masks", ["keep", "segments"])
def test_backward_padding_and_packing(ops, masks):
    """The D = 256 backward reads each key's queries (key_rows) from tk::attention_varlen's tables."""
    B, Hq, Hkv, N, D = 4, 8, 4, 333, 256
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(B, Hq, Hkv, N, N, D, torch.bfloat16,
                                                               layout="bnhd", seed=9))
    keep = keep_of(B, N, seed=4) if masks == "keep" else None
    segments = segments_of(B, N, seed=5) if masks == "segments" else None
    o, _ = torch.ops.tk.attention_varlen(q, k, v, keep, segments, True, 1 / 16)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference(qr, kr, vr, True, 1 / 16, keep=keep, segments=segments)
    want = torch.autograd.grad(o_ref, (qr, kr, vr), do.float())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert not torch.isnan(g).any() and rel_err(g, w) < GRAD_TOL, f"{name}: {rel_err(g, w):.3e}"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hf_gemma2_generate_with_the_kernels(cache):
    """generate() of an HF Gemma-2 (bf16, head dim 256, GQA 4:2, softcap 50, sliding window on alternate layers,
    eager attention) with a compiled forward: tokens and logits are eager's, and every graph's attention is replaced
    (the prefill by the D = 256 forward kernels, the decode steps by the split-KV ones)."""
    transformers = pytest.importorskip("transformers")
    import tk_inductor

    cfg = transformers.Gemma2Config(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                    max_position_embeddings=2048, sliding_window=64, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=256,
                                    attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(1, 256, (2, 300), device="cuda")
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
              cache_implementation=cache)
    want = model.generate(ids, **kw)
    tk_inductor.reset()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="thunderkittens", options={"strict": True})
    got = model.generate(ids, **kw)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert rel_err(a, b) < 2e-2, f"step {step}: logits differ by {rel_err(a, b):.3e}"
    assert torch.equal(got.sequences, want.sequences)
    graphs = tk_inductor.report().graphs
    assert graphs and all(g.replaced.get("attention", 0) == 2 for g in graphs), graphs


@pytest.mark.parametrize("D, Dv", [(192, 128), (96, 64), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_value_head_dim(ops, monkeypatch, D, Dv, causal):
    """Multi-head latent attention's head dims (DeepSeek: q/k 192, v 128) through tk::attention, which runs the
    kernels on q/k and v zero-padded to the larger: forward and backward, GQA, the (B, N, H, D) layout, odd lengths."""
    from kernel_checks import record_raw_calls

    calls = record_raw_calls(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(D + Dv)
    B, Hq, Hkv, N = 2, 8, 4, 777

    def heads(h, d):  # (B, H, N, d) views of (B, N, H, d) buffers, as HF's projections give them
        return torch.randn(B, N, h, d, device="cuda", generator=g).bfloat16().transpose(1, 2).detach().requires_grad_()

    q, k, v = heads(Hq, D), heads(Hkv, D), heads(Hkv, Dv)
    scale = D ** -0.5
    o, lse = torch.ops.tk.attention(q, k, v, causal, scale)
    assert o.shape == (B, Hq, N, Dv) and o.transpose(1, 2).is_contiguous() and not o.isnan().any()
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference(qr, kr, vr, causal, scale)
    assert rel_err(o, o_ref) < OUT_TOL
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref.backward(do.float())
    for name, got, like, ref in zip(("dq", "dk", "dv"), grads, (q, k, v), (qr.grad, kr.grad, vr.grad)):
        assert got.shape == like.shape and not got.isnan().any()
        assert rel_err(got, ref) < GRAD_TOL, f"{name}: relative error {rel_err(got, ref):.3e}"
    assert calls == ["attention", "attention_backward"]
