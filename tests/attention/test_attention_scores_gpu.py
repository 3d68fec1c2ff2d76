"""GPU tests of the attention kernels' score modifications: sliding windows (causal, key j visible from query i when
i - window < j <= i) and softcapping (s = cap * tanh(s / cap)), forward and backward, against an fp32 autograd
reference. Skipped without CUDA.

Windows cover the edges of the kernels' tiles: 1 (each query sees only itself), windows shorter than, equal to and
longer than a key block (128) and a query tile (128 or 192 rows), and windows longer than the sequence.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from test_attention_gpu import GRAD_TOL, OUT_TOL, make_inputs, poison, reference, rel_err, trains_like_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def ops():
    from tk_inductor import build

    build.load("attention")
    return torch.ops.tk_cuda


def cases():
    out = []
    # windows around the tile edges, at D 64 (query tiles of 192 rows) and 128 (128 rows)
    for i, (window, D) in enumerate(itertools.product((1, 17, 127, 128, 129, 300, 1000, 5000), (64, 128))):
        dtype = (torch.bfloat16, torch.float16)[i % 2]
        heads = ((4, 4), (8, 2))[(i // 2) % 2]
        out.append((2, *heads, 1000, 1000, D, dtype, True, window, 0.0))
    # the cap, with and without a mask or a window, fp16 and bf16
    for D, causal, window, cap in itertools.product((64, 128), (False, True), (0, 200), (5.0, 50.0)):
        if window and not causal:
            continue
        out.append((2, 8, 2, 777, 777, D, torch.bfloat16 if cap > 10 else torch.float16, causal, window, cap))
    # other lengths: short, N < M (rows see the first keys), long
    for N, M, D in ((1, 1, 128), (17, 17, 64), (129, 129, 128), (200, 700, 64), (300, 1000, 128), (4096, 4096, 128),
                    (4096, 4096, 64)):
        out.append((1, 4, 1, N, M, D, torch.bfloat16, True, 100, 30.0))
    return out


def _id(c):
    B, Hq, Hkv, N, M, D, dtype, causal, window, cap = c
    return (f"B{B}-H{Hq}:{Hkv}-N{N}-M{M}-D{D}-{str(dtype)[6:]}-{'causal' if causal else 'full'}"
            f"-w{window}-cap{cap:g}")


@pytest.mark.parametrize("case", cases(), ids=_id)
def test_forward_backward(ops, case):
    from tk_inductor.ops.attention import grad_like

    B, Hq, Hkv, N, M, D, dtype, causal, window, cap = case
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, dtype, layout=("bhnd", "bnhd")[N % 2], seed=2)
    scale = 1.0 / math.sqrt(D)
    poison(((B, N, Hq, D), dtype), ((B, Hq, N), torch.float32))
    o, lse = ops.attention(q, k, v, causal, scale, window, cap)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference(qr, kr, vr, causal, scale, window, cap)
    assert rel_err(o, o_ref) < OUT_TOL
    torch.testing.assert_close(lse, lse_ref.detach(), atol=2e-3, rtol=1e-4)

    do = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    poison(((B, Hq, N, D), dtype), ((B, Hkv, M, D), dtype), ((B, Hkv, M, D), dtype))
    dq, dk, dv = ops.attention_backward(do, q, k, v, o, lse, causal, scale, window, cap)
    torch.cuda.synchronize()
    o_ref.backward(do.float())
    for name, got, like, ref in (("dq", dq, q, qr.grad), ("dk", dk, k, kr.grad), ("dv", dv, v, vr.grad)):
        assert got.stride() == grad_like(like).stride() and not torch.isnan(got).any()
        assert rel_err(got, ref) < GRAD_TOL, f"{name}: relative error {rel_err(got, ref):.3e}"


@pytest.mark.parametrize("window, cap", [(300, 0.0), (0, 20.0), (64, 20.0)])
def test_negative_scale(ops, window, cap):
    """scale <= 0: folded into q by the binding (without a cap), or taken by the capped kernels as it is."""
    q, k, v = make_inputs(2, 4, 2, 500, 500, 128, torch.bfloat16, seed=5)
    o, lse = ops.attention(q, k, v, True, -0.1, window, cap)
    o_ref, lse_ref = reference(q, k, v, True, -0.1, window, cap)
    assert rel_err(o, o_ref) < OUT_TOL
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)


def test_window_longer_than_the_sequence_is_causal(ops):
    q, k, v = make_inputs(2, 4, 4, 700, 700, 64, torch.bfloat16, seed=6)
    a = ops.attention(q, k, v, True, 0.125, 700)
    b = ops.attention(q, k, v, True, 0.125)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)


@pytest.mark.parametrize("args, message", [
    ((False, 0.1, 16, 0.0), "needs causal"),
    ((True, 0.1, -1, 0.0), "window must be"),
    ((True, 0.1, 0, -2.0), "softcap must be"),
    ((True, 0.1, 0, math.inf), "softcap must be"),
])
def test_bad_arguments(ops, args, message):
    q, k, v = make_inputs(1, 2, 2, 64, 64, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        ops.attention(q, k, v, *args)


@pytest.mark.parametrize("model", ["mistral", "gemma2", "phi3"])
def test_hf_models_train_with_the_kernels(model):
    """Mistral (sliding window, SDPA), Gemma-2 (window on alternate layers, softcap 50, eager attention) and Phi-3
    (head dim 96, window) in bf16 on the GPU: every layer's attention is replaced, and the loss and gradients match
    eager's."""
    transformers = pytest.importorskip("transformers")
    import tk_inductor

    common = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, max_position_embeddings=2048, sliding_window=200)
    if model == "mistral":
        net = transformers.MistralForCausalLM(transformers.MistralConfig(**common, attn_implementation="sdpa"))
    elif model == "phi3":
        common.update(hidden_size=384, head_dim=96, pad_token_id=0, eos_token_id=0, bos_token_id=0)
        net = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, attn_implementation="sdpa"))
    else:
        net = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=128,
            attn_implementation="eager"))
    torch.manual_seed(0)
    net = net.cuda().bfloat16().train()
    ids = torch.randint(0, 512, (2, 1000), device="cuda")
    tk_inductor.reset()
    torch._dynamo.reset()
    compiled = torch.compile(net, backend="thunderkittens")
    assert trains_like_eager(net, compiled, input_ids=ids, labels=ids) == 2, str(tk_inductor.report())
