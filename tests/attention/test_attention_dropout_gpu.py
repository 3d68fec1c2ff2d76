"""GPU tests of the attention kernels' dropout: the mask the forward and backward kernels draw is bit for bit the
reference's (philox.attention_keep_mask), and outputs and gradients with dropout match the fp32 reference with that
mask, for head dims up to 128, both dtypes, causal or not, windows, GQA and odd lengths, and under padding masks
(tk::attention_varlen). Skipped without CUDA."""
from __future__ import annotations

import math

import pytest
import torch

from test_attention_gpu import GRAD_TOL, OUT_TOL, make_inputs, ops, poison, rel_err  # noqa: F401 (ops: the fixture)

from tk_inductor.ops import philox
from tk_inductor.ops.attention import attention_backward_reference, attention_reference, grad_like

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _keep(B, H, N, M, rng, p):
    seed, offset = philox.unpack(rng)
    return philox.attention_keep_mask(B * H, N, M, seed, offset, p, "cuda").view(B, H, N, M)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_draw_the_reference_mask(ops, D, dtype):
    """q = k = 0 makes every probability 1 / M, and v = the identity reads each one out: o[i, j] = keep / (1 - p) / M.
    dO = the identity does the same for dV's kept probabilities: dv[j, i] = keep[i, j] / (1 - p) / M."""
    B, H, N, M, p = 2, 3, D, D, 0.25
    q = torch.zeros(B, H, N, D, device="cuda", dtype=dtype)
    eye = torch.eye(D, device="cuda", dtype=dtype).expand(B, H, D, D).contiguous()
    rng = philox.draw_seed()
    o, lse = ops.attention(q, q, eye, False, 0.5, 0, 0.0, p, rng)
    keep = _keep(B, H, N, M, rng, p)
    val = philox.dropout_scale(p) / M
    torch.testing.assert_close(o.float(), keep * val, rtol=1e-2, atol=0)
    _, _, dv = ops.attention_backward(eye, q, q, eye, o, lse, False, 0.5, 0, 0.0, p, rng)
    torch.testing.assert_close(dv.float(), keep.transpose(-1, -2) * val, rtol=1e-2, atol=0)


def cases():
    out = []
    for D in (32, 64, 80, 96, 128):
        for causal in (False, True):
            out.append((2, 4, 2, 333, 333, D, (torch.bfloat16, torch.float16)[D % 3 == 0], causal, 0, 0.1))
    out += [
        (1, 8, 8, 1000, 1000, 128, torch.bfloat16, True, 300, 0.1),  # a window
        (2, 4, 1, 200, 700, 64, torch.float16, True, 0, 0.5),  # N < M, GQA 4
        (2, 4, 4, 700, 200, 128, torch.bfloat16, False, 0, 0.9),
        (1, 2, 2, 5, 5, 64, torch.bfloat16, True, 0, 0.1),  # a short training sequence (not the decode kernels)
        (4, 12, 12, 1024, 1024, 64, torch.bfloat16, True, 0, 0.1),  # GPT-2's geometry
    ]
    return out


def _id(c):
    B, Hq, Hkv, N, M, D, dtype, causal, window, p = c
    return f"B{B}-H{Hq}:{Hkv}-N{N}-M{M}-D{D}-{str(dtype)[6:]}-{'causal' if causal else 'full'}-w{window}-p{p}"


@pytest.mark.parametrize("case", cases(), ids=_id)
def test_forward_backward(ops, case):
    B, Hq, Hkv, N, M, D, dtype, causal, window, p = case
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, dtype, layout=("bhnd", "bnhd")[N % 2], seed=3)
    scale = 1.0 / math.sqrt(D)
    rng = philox.draw_seed()
    poison(((B, N, Hq, D), dtype), ((B, Hq, N), torch.float32))
    o, lse = ops.attention(q, k, v, causal, scale, window, 0.0, p, rng)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    qf, kf, vf = (t.float() for t in (q, k, v))
    o_ref, lse_ref = attention_reference(qf, kf, vf, causal, scale, window, 0.0, None, p, rng)
    assert rel_err(o, o_ref) < OUT_TOL
    rows = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[rows], lse_ref[rows], atol=2e-3, rtol=1e-4)
    # the same pair draws the same mask
    again, _ = ops.attention(q, k, v, causal, scale, window, 0.0, p, rng.clone())
    assert torch.equal(o, again)

    do = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    poison(((B, Hq, N, D), dtype), ((B, Hkv, M, D), dtype), ((B, Hkv, M, D), dtype))
    dq, dk, dv = ops.attention_backward(do, q, k, v, o, lse, causal, scale, window, 0.0, p, rng)
    torch.cuda.synchronize()
    refs = attention_backward_reference(do.float(), qf, kf, vf, o.float(), lse, causal, scale, None, window, 0.0, p,
                                        rng)
    for name, got, like, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), (q, k, v), refs):
        assert got.stride() == grad_like(like).stride() and not torch.isnan(got).any()
        assert rel_err(got, ref) < GRAD_TOL, f"{name}: relative error {rel_err(got, ref):.3e}"


def test_op_routes_dropout(ops):
    """tk::attention with dropout: the kernels at head dims up to 128, the reference above (D 256) and with a
    softcap, both equal to the reference with the same mask."""
    from tk_inductor.ops import attention as A

    for D, cap in ((64, 0.0), (256, 0.0), (64, 30.0)):
        q, k, v = make_inputs(1, 2, 2, 150, 150, D, torch.bfloat16, seed=4)
        rng = philox.draw_seed()
        o, _ = torch.ops.tk.attention(q, k, v, True, D ** -0.5, 0, cap, 0.2, rng)
        o_ref, _ = A.attention_reference(q.float(), k.float(), v.float(), True, D ** -0.5, 0, cap, None, 0.2, rng)
        assert rel_err(o, o_ref) < OUT_TOL, (D, cap)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_varlen_with_dropout(causal, D):
    """tk::attention_varlen with dropout: the kernels on interval tables (right padding; left padding, whose rows
    have no key under a causal mask) and the reference for an entry with a hole, each drawing the stream's query
    heads b * Hq + h: equal to the fp32 reference, forward and backward."""
    from tk_inductor.ops import attention_varlen as AV

    B, H, N, p, scale = 3, 4, 300, 0.15, D ** -0.5
    q, k, v = make_inputs(B, H, H, N, N, D, torch.bfloat16, seed=5)
    keys = torch.ones(B, N, dtype=torch.bool, device="cuda")
    keys[0, 201:] = False
    keys[1, :77] = False
    keys[2, 100:140] = False
    rng = philox.draw_seed()
    before = dict(AV.varlen_paths)
    o, lse = torch.ops.tk.attention_varlen(q, k, v, keys, None, causal, scale, 0, 0.0, False, p, rng)
    assert AV.varlen_paths["kernel"] == before["kernel"] + 1
    assert AV.varlen_paths["reference entries"] == before["reference entries"] + 1  # the entry with a hole
    qf, kf, vf = q.float(), k.float(), v.float()
    o_ref, _ = AV.attention_varlen_reference(qf, kf, vf, keys, None, causal, scale, 0, 0.0, False, p, rng)
    assert rel_err(o, o_ref) < OUT_TOL
    do = torch.randn_like(o)
    grads = torch.ops.tk.attention_varlen_backward(do, q, k, v, keys, None, o, lse, causal, scale, 0, 0.0, False, p,
                                                   rng)
    refs = AV.attention_varlen_backward_reference(do.float(), qf, kf, vf, keys, None, o.float(), causal, scale, 0, 0.0,
                                                  False, p, rng)
    for name, g, r in zip("qkv", grads, refs):
        assert rel_err(g, r) < GRAD_TOL, name


def test_compiled_gpt2_trains_with_attention_dropout():
    """GPT-2 with attention dropout 0.1 compiled with the kernels: attention replaced in training, finite loss and
    gradients, and without dropout (eval) the same logits as eager."""
    transformers = pytest.importorskip("transformers")
    import tk_inductor

    cfg = transformers.GPT2Config(vocab_size=512, n_embd=256, n_head=4, n_layer=2, n_positions=512, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16).train()
    ids = torch.randint(0, 512, (2, 300), device="cuda")
    tk_inductor.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="thunderkittens")
    loss = compiled(ids, labels=ids).loss
    report = tk_inductor.report()
    assert report.replaced.get("attention", 0) == 2, str(report)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_compiled_bert_trains_with_padding_and_attention_dropout():
    """BERT fine-tuning's batch (right padding, attention dropout 0.1) compiled with the kernels: attention replaced
    by tk::attention_varlen with dropout, finite loss and gradients."""
    transformers = pytest.importorskip("transformers")
    import tk_inductor

    cfg = transformers.BertConfig(vocab_size=512, hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                                  intermediate_size=512, max_position_embeddings=512, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg).cuda().to(torch.bfloat16).train()
    ids = torch.randint(0, 512, (3, 300), device="cuda")
    mask = torch.ones(3, 300, dtype=torch.long, device="cuda")
    mask[0, 250:] = 0
    mask[2, 111:] = 0
    tk_inductor.reset()
    torch._dynamo.reset()
    loss = torch.compile(model, backend="thunderkittens")(input_ids=ids, attention_mask=mask, labels=ids).loss
    report = tk_inductor.report()
    assert report.replaced.get("attention", 0) == 2, str(report)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
