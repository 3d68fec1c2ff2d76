"""Attention dropout on the CPU: the Philox stream of the kernels (philox.attention_keep_mask), the op's reference
forward and backward against a plain formula with the same mask, its argument checks, and the matcher replacing
SDPA's dropout_p and the eager dropout of the attention weights in training (reference mode), including GPT-2 and
BERT under a padding mask (tk::attention_varlen's dropout)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tk_inductor
from tk_inductor.ops import philox
from tk_inductor.ops.attention import attention_reference

from attention_helpers import Fn, _compile, _eager, _inputs, _qkv

P = 0.3


def _kept(bh: int, i: int, j: int, seed: int, offset: int, p: float) -> bool:
    """The stream, one element at a time (csrc/kernels/attention/dropout.cuh's definition: Philox4x32-7)."""
    ig, jg = (i // 16) * 8 + i % 8, (j // 16) * 4 + (j % 8) // 2
    counter = tuple(torch.tensor([x], dtype=torch.int64) for x in (jg, ig, bh, offset & philox.MASK32))
    words = philox.philox4x32(counter, (seed & philox.MASK32, seed >> 32), rounds=7)
    h = (i // 8) % 2 + 2 * (j % 2) + 4 * ((j // 8) % 2)
    half = (int(words[h // 2]) >> (16 * (h % 2))) & 0xFFFF
    return half >= math.floor(p * 65536)


def test_keep_mask_is_the_documented_stream():
    seed, offset = 0x1234_5678_9ABC_DEF1, 0xFEDC_BA98_7654_3211
    keep = philox.attention_keep_mask(3, 40, 37, seed, offset, P)
    for bh, i, j in [(0, 0, 0), (0, 8, 0), (0, 0, 8), (0, 8, 8), (0, 0, 1), (0, 9, 9), (1, 17, 33), (2, 39, 36),
                     (2, 23, 15), (1, 31, 24), (1, 30, 25)]:
        assert bool(keep[bh, i, j]) == _kept(bh, i, j, seed, offset, P), (bh, i, j)


def test_keep_mask_rate_and_seeds():
    a = philox.attention_keep_mask(4, 256, 256, 7, 11, P)
    assert abs(a.float().mean().item() - (1 - P)) < 0.01
    assert torch.equal(a, philox.attention_keep_mask(4, 256, 256, 7, 11, P))
    for seed, offset in ((8, 11), (7, 12)):
        b = philox.attention_keep_mask(4, 256, 256, seed, offset, P)
        assert 0.3 < (a != b).float().mean().item() < 0.5  # independent masks differ in 2 p (1 - p) of the elements
    # the groups' four words are independent: neighbours 8 apart agree no more than chance
    same = (a[:, :248, :] == a[:, 8:, :]).float().mean().item()
    assert abs(same - (P * P + (1 - P) ** 2)) < 0.01


def _formula(q, k, v, causal, scale, p, rng, keys=None):
    """softmax(s) ∘ keep / (1 - p) @ v, plainly (fp64 autograd); keys: a (B, M) bool key-padding mask (a row
    without keys gets 0)."""
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if keys is not None:
        s = s.masked_fill(~keys[:, None, None, :], float("-inf"))
    seed, offset = philox.unpack(rng)
    B, H, N, M = s.shape
    keep = philox.attention_keep_mask(B * H, N, M, seed, offset, p).view(B, H, N, M)
    return (torch.softmax(s, -1).nan_to_num(0.0) * keep / (1 - p)) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N, M", [(19, 19), (11, 40)])
def test_op_forward_backward(causal, N, M):
    q, k, v = _qkv(2, 3, 3, N, M, 8, grad=True, seed=1)
    rng = philox.draw_seed()
    scale = 0.4
    o, lse = torch.ops.tk.attention(q, k, v, causal, scale, 0, 0.0, P, rng)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = _formula(qr, kr, vr, causal, scale, P, rng)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref.float())
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(o_ref, (qr, kr, vr), do)
    for a, b in zip(got, want):  # the backward's P = exp(s - lse) from the fp32 lse
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the same pair gives the same output; another pair another mask
    again, _ = torch.ops.tk.attention(q, k, v, causal, scale, 0, 0.0, P, rng.clone())
    assert torch.equal(o, again)
    other, _ = torch.ops.tk.attention(q, k, v, causal, scale, 0, 0.0, P, philox.draw_seed())
    assert not torch.equal(o, other)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_op_forward_backward(causal):
    """tk::attention_varlen with dropout: entry b's heads draw the stream's query heads b * Hq + h, as in
    tk::attention over the whole batch (right padding, left padding, a hole)."""
    B, H, N, D = 3, 2, 13, 8
    q, k, v = _qkv(B, H, H, N, N, D, grad=True, seed=2)
    keys = torch.ones(B, N, dtype=torch.bool)
    keys[0, 9:] = False
    keys[1, :4] = False
    keys[2, 5:7] = False
    rng = philox.draw_seed()
    o, _ = torch.ops.tk.attention_varlen(q, k, v, keys, None, causal, 0.35, 0, 0.0, False, P, rng)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o_ref, _ = _formula(qr, kr, vr, causal, 0.35, P, rng, keys)
    torch.testing.assert_close(o, o_ref)
    do = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(o_ref, (qr, kr, vr), do)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_op_dropout_arguments_checked():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="needs rng"):
        torch.ops.tk.attention(q, k, v, True, 0.25, 0, 0.0, 0.1)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        torch.ops.tk.attention(q, k, v, True, 0.25, 0, 0.0, 1.0, philox.draw_seed())
    with pytest.raises(ValueError, match="needs rng"):
        torch.ops.tk.attention(q, k, v, True, 0.25, 0, 0.0, 0.1, torch.zeros(2, dtype=torch.int32))


def test_reference_without_dropout_unchanged():
    q, k, v = _qkv(1, 2, 2, 9, 9, 8)
    o0, lse0 = attention_reference(q, k, v, True, 0.3)
    o1, lse1 = attention_reference(q, k, v, True, 0.3, dropout_p=0.0, rng=philox.draw_seed())
    assert torch.equal(o0, o1) and torch.equal(lse0, lse1)


# ---------------------------------------------------------------------------- the matcher (reference mode)

def _compiled_equals_formula(fn, causal, scale, seed=3):
    """fn compiled (reference mode) replaces its attention, and equals the formula with the pair its graph drew:
    the graph's tk::philox_seed is the first draw from the CPU generator after manual_seed, as philox.draw_seed."""
    q, k, v = _inputs(N=12, M=12, D=16)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    compiled = _compile(Fn(fn))
    torch.manual_seed(seed)
    out = compiled(q, k, v)
    report = tk_inductor.report()
    assert report.replaced.get("attention", 0) == 1, str(report)
    torch.manual_seed(seed)
    rng = philox.draw_seed()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = _formula(qr, kr, vr, causal, scale, P, rng)
    torch.testing.assert_close(out, ref)
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (qr, kr, vr), do)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # each run draws a new pair
    assert not torch.equal(compiled(q, k, v), out)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_dropout_replaced(causal):
    _compiled_equals_formula(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=causal),
                             causal, 1 / math.sqrt(16))


def test_eager_dropout_in_training_replaced():
    _compiled_equals_formula(_eager(dropout=(P, True)), True, 1 / math.sqrt(16))


def test_dropout_with_softcap_kept():
    def fn(q, k, v):
        s = 20.0 * torch.tanh(q @ k.transpose(-1, -2) * 0.25 / 20.0)
        return F.dropout(torch.softmax(s, -1), p=P, training=True) @ v

    torch.manual_seed(0)
    _compile(Fn(fn))(*_inputs())
    report = tk_inductor.report()
    assert report.replaced.get("attention", 0) == 0
    assert any("dropout on softcapped scores" in r for f, r in report.kept if f == "attention"), str(report)


def test_dropout_with_a_graph_input_mask_kept():
    class WithMask(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=P)

    q, k, v = _inputs()
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    torch.manual_seed(0)
    _compile(WithMask())(q, k, v, mask)
    report = tk_inductor.report()
    assert report.replaced.get("attention", 0) == 0
    assert any("mask handed into the graph" in r for f, r in report.kept if f == "attention"), str(report)


def test_gpt2_training_with_attention_dropout_replaced():
    transformers = pytest.importorskip("transformers")
    for impl in ("sdpa", "eager"):
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=64, n_head=2, n_layer=2, n_positions=64, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.1, attn_implementation=impl)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).train()
        ids = torch.randint(0, 64, (2, 24))
        loss = _compile(model)(ids, labels=ids).loss
        report = tk_inductor.report()
        assert report.replaced.get("attention", 0) == 2, (impl, str(report))
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                            if p.grad is not None)
        model.eval()  # dropout off: the compiled model equals eager
        with torch.no_grad():
            torch.testing.assert_close(_compile(model)(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_bert_training_with_padding_and_attention_dropout_replaced():
    """BERT fine-tuning's batch: a padding mask and attention dropout 0.1 (tk::attention_varlen with dropout)."""
    transformers = pytest.importorskip("transformers")
    for impl in ("sdpa", "eager"):
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=64, num_attention_heads=2, num_hidden_layers=2,
                                      intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.1, attn_implementation=impl)
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(cfg).train()
        ids = torch.randint(0, 64, (3, 20))
        mask = torch.ones(3, 20, dtype=torch.long)
        mask[0, 15:] = 0
        mask[1, 7:] = 0
        loss = _compile(model)(input_ids=ids, attention_mask=mask, labels=ids).loss
        report = tk_inductor.report()
        assert report.replaced.get("attention", 0) == 2, (impl, str(report))
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                            if p.grad is not None)
