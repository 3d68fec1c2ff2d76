"""GPU tests of tk::attention_varlen: the attention kernels under key-padding masks and packed sequences (interval
tables: each query's keys, each key's queries), forward and backward, against an fp32 autograd reference with the
dense mask. Skipped without CUDA.

The entries of each case cover left padding (rows before the first key see nothing under a causal mask: o = 0),
right padding, both, none, an entry without keys and ranges that start or end inside a key block and a query tile;
packed sequences of random lengths (some shorter than a tile, some longer than several), alone and under padding;
two-sided windows (encoders), alone, under padding and over packed sequences.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import tk_inductor.ops.attention  # noqa: F401  (registers tk::attention_varlen)
from test_attention_gpu import (GRAD_TOL, OUT_TOL, make_inputs, ops, poison, reference, rel_err,  # noqa: F401 (ops)
                                trains_like_eager)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def keep_of(B, M, seed, holes=False):
    """(B, M) bool: entry 0 right-padded, 1 left-padded, 2 both, 3 none, 4 empty, the rest random ranges; with
    `holes`, entry 1 also has a gap inside its range."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(B, M, dtype=torch.bool)
    for b in range(B):
        lo, hi = sorted(torch.randint(0, M + 1, (2,), generator=g).tolist())
        start, end = [(0, hi), (lo, M), (lo, hi), (0, M), (0, 0)][b] if b < 5 else (lo, hi)
        keep[b, start:end] = True
    if holes and B > 1 and M > 8:
        keep[1, M - 6:M - 3] = False
        keep[1, M - 1] = True
    return keep.cuda()


def segments_of(B, N, seed):
    """(B, N) nondecreasing packed-sequence ids: runs of random lengths from 1 to about N / 3."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        cuts = torch.randint(1, max(2, N // 3), (N,), generator=g).cumsum(0)
        for c in cuts[cuts < N].tolist():
            seg[b, c:] += 1
    return seg.cuda()


def cases():
    out = []
    for i, ((N, M), causal, D) in enumerate(itertools.product([(1000, 1000), (333, 517), (129, 129), (17, 300)],
                                                              (False, True), (64, 128, 96))):
        if causal and N != M and i % 2:
            continue
        dtype = (torch.bfloat16, torch.float16)[i % 2]
        heads = ((4, 4), (8, 2))[(i // 2) % 2]
        window = 200 if causal and i % 3 == 0 else 0
        cap = 30.0 if i % 4 == 1 else 0.0
        out.append((6, *heads, N, M, D, dtype, causal, window, cap))
    return out


def _id(c):
    B, Hq, Hkv, N, M, D, dtype, causal, window, cap = c
    return (f"B{B}-H{Hq}:{Hkv}-N{N}-M{M}-D{D}-{str(dtype)[6:]}-{'causal' if causal else 'full'}"
            f"{f'-w{window}' if window else ''}{f'-cap{cap:g}' if cap else ''}")


@pytest.mark.parametrize("masks", ["keep", "holes", "segments", "both"])
@pytest.mark.parametrize("case", cases(), ids=_id)
def test_forward_backward(ops, case, masks):
    B, Hq, Hkv, N, M, D, dtype, causal, window, cap = case
    if masks in ("segments", "both") and N != M:
        pytest.skip("packed sequences are self-attention")
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, dtype, layout="bnhd", seed=N + D)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    keep = keep_of(B, M, seed=N + M, holes=masks == "holes") if masks != "segments" else None
    segments = segments_of(B, N, seed=N + D) if masks in ("segments", "both") else None
    scale = 1.0 / math.sqrt(D)
    poison(((B, N, Hq, D), dtype), ((B, Hq, N), torch.float32))
    o, lse = torch.ops.tk.attention_varlen(q, k, v, keep, segments, causal, scale, window, cap)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    assert not any(torch.isnan(t).any() for t in (o, dq, dk, dv))

    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference(qr, kr, vr, causal, scale, window, cap, keep=keep, segments=segments)
    assert rel_err(o, o_ref) < OUT_TOL
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isinf(lse) & (lse > 0), ~seen), "rows without keys: lse +inf"
    torch.testing.assert_close(lse[seen], lse_ref[seen], atol=2e-3, rtol=1e-4)
    grads = torch.autograd.grad(o_ref, (qr, kr, vr), do.float())
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        assert rel_err(got, want) < GRAD_TOL, f"{name}: relative error {rel_err(got, want):.3e}"


@pytest.mark.parametrize("masks", ["none", "keep", "segments"])
@pytest.mark.parametrize("N, D, window, dtype", [(1000, 64, 65, torch.bfloat16), (333, 128, 17, torch.float16),
                                                  (129, 96, 200, torch.bfloat16), (2100, 128, 129, torch.bfloat16)])
def test_two_sided_window(ops, monkeypatch, masks, N, D, window, dtype):
    """Encoders' two-sided windows (|i - j| < window: ModernBERT's local attention) run on the interval tables, alone
    (tables built from the batch), under padding and over packed sequences, forward and backward."""
    from kernel_checks import record_raw_calls

    calls = record_raw_calls(monkeypatch)
    B, Hq, Hkv = 6, 4, 2
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(B, Hq, Hkv, N, N, D, dtype, layout="bnhd",
                                                                 seed=N + window))
    keep = keep_of(B, N, seed=N) if masks == "keep" else None
    segments = segments_of(B, N, seed=N) if masks == "segments" else None
    scale = 1.0 / math.sqrt(D)
    o, lse = torch.ops.tk.attention_varlen(q, k, v, keep, segments, False, scale, window)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    assert calls == ["attention", "attention_backward"]
    assert not any(torch.isnan(t).any() for t in (o, dq, dk, dv))
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference(qr, kr, vr, False, scale, window, keep=keep, segments=segments)
    assert rel_err(o, o_ref) < OUT_TOL
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isinf(lse) & (lse > 0), ~seen), "rows without keys: lse +inf"
    torch.testing.assert_close(lse[seen], lse_ref[seen], atol=2e-3, rtol=1e-4)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), torch.autograd.grad(o_ref, (qr, kr, vr), do.float())):
        assert rel_err(got, want) < GRAD_TOL, f"{name}: relative error {rel_err(got, want):.3e}"


@pytest.mark.parametrize("N, chunk", [(2100, 512), (1000, 333)])
def test_chunked_attention(ops, N, chunk):
    """Llama-4's chunked attention through the adapter the matcher calls: the chunks of positions as packed
    sequences (segments = i // chunk), causal, forward and backward."""
    from tk_inductor.ops.attention_varlen import attention_varlen_adapter

    B, Hq, Hkv, D = 2, 8, 2, 128
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(B, Hq, Hkv, N, N, D, torch.bfloat16, seed=N))
    scale = D ** -0.5
    o = attention_varlen_adapter(q, k, v, True, scale, 0, 0.0, None, 0, None, False, 0.0, chunk)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    segments = (torch.arange(N, device="cuda") // chunk)[None].expand(B, N)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference(qr, kr, vr, True, scale, segments=segments)
    assert rel_err(o, o_ref) < OUT_TOL
    for name, got, want in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(o_ref, (qr, kr, vr), do.float())):
        assert rel_err(got, want) < GRAD_TOL, f"{name}: relative error {rel_err(got, want):.3e}"


def test_uniform_empty_rows_average_v(ops):
    """uniform_empty (an eager model's finite fill): left-padded rows get the mean of v over every key, exactly as
    softmax over equal scores: the kernel runs every entry and the reference recomputes only those rows."""
    from tk_inductor.ops import attention_varlen as AV

    B, H, N, D = 3, 4, 300, 64
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(B, H, H, N, N, D, torch.bfloat16, seed=7))
    keep = torch.ones(B, N, dtype=torch.bool, device="cuda")
    keep[0, :40] = False  # left padding: rows 0..39 see no key under the causal mask
    keep[1, 250:] = False  # right padding: every row sees a key
    before = dict(AV.varlen_paths)
    o, _ = torch.ops.tk.attention_varlen(q, k, v, keep, None, True, 0.125, 0, 0.0, True)
    assert AV.varlen_paths["reference entries"] - before["reference entries"] == 0
    assert AV.varlen_paths["uniform rows"] - before["uniform rows"] == 40
    mask = torch.where(keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool, device="cuda").tril(), 0.0,
                       torch.finfo(torch.float32).min)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = torch.softmax(qf @ kf.transpose(-1, -2) * 0.125 + mask, -1) @ vf
    assert rel_err(o, want) < OUT_TOL
    torch.testing.assert_close(o[0, :, :40].float(), vf[0].mean(1, keepdim=True).expand(H, 40, D).detach(),
                               atol=1e-2, rtol=1e-2)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    ref = torch.autograd.grad(want, (qf, kf, vf), do.float())
    for g, r in zip(got, ref):
        assert rel_err(g, r) < GRAD_TOL


def test_kernel_matches_tk_attention_without_padding(ops):
    """An all-ones keep and one sequence give tk::attention's result bit for bit (same kernels, full intervals)."""
    q, k, v = make_inputs(2, 8, 2, 777, 777, 128, torch.bfloat16, seed=2)
    keep = torch.ones(2, 777, dtype=torch.bool, device="cuda")
    for causal in (False, True):
        o, lse = torch.ops.tk.attention_varlen(q, k, v, keep, torch.zeros_like(keep, dtype=torch.long), causal, 0.09)
        o2, lse2 = ops.attention(q, k, v, causal, 0.09)
        assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_bad_interval_tables(ops):
    q, k, v = make_inputs(2, 4, 4, 64, 64, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="row_keys must be a contiguous int32"):
        torch.ops.tk_cuda.attention(q, k, v, False, 0.1, 0, 0.0, row_keys=torch.zeros(2, 64, 2, dtype=torch.long, device="cuda"))
    with pytest.raises(RuntimeError, match="row_keys must be a contiguous int32"):
        torch.ops.tk_cuda.attention(q, k, v, False, 0.1, 0, 0.0, row_keys=torch.zeros(2, 2, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("batch", ["left-padded", "right-padded", "packed", "bert-padded"])
def test_hf_models_with_the_kernels(batch):
    """HF models in bf16 on the GPU with run-time masks: a Llama on a left- or right-padded batch or on packed
    sequences (restarting position ids) trains with every layer's attention replaced, and BERT on a padded batch
    infers; loss, logits and gradients match eager's. Padding positions carry no label (-100, as HF's collators
    set them): eager SDPA on the H200 may take cuDNN, whose rows without a visible key (left padding) hold values
    that are neither SDPA's 0 nor NaN, and those rows then feed only the padding positions' own outputs."""
    transformers = pytest.importorskip("transformers")
    import tk_inductor

    torch.manual_seed(0)
    N = 700
    if batch == "bert-padded":
        net = transformers.BertModel(transformers.BertConfig(
            vocab_size=512, hidden_size=512, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
            max_position_embeddings=1024, attn_implementation="sdpa", hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    else:
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=2048, attn_implementation="sdpa"))
    net = net.cuda().bfloat16()
    ids = torch.randint(0, 512, (3, N), device="cuda")
    inputs = {"input_ids": ids}
    if batch == "packed":
        pos = torch.arange(N).repeat(3, 1)
        for b, cuts in enumerate(([150, 151, 500], [300], [10, 330, 631])):
            for c in cuts:
                pos[b, c:] -= pos[b, c].item()
        inputs["position_ids"] = pos.cuda()
    else:
        am = torch.ones(3, N, dtype=torch.long)
        am[0, :250] = 0 if batch == "left-padded" else 1
        am[1, N - 333:] = 0 if batch != "left-padded" else 1
        am[1, :77] = 0 if batch == "left-padded" else 1
        inputs["attention_mask"] = am.cuda()
    tk_inductor.reset()
    torch._dynamo.reset()
    compiled = torch.compile(net, backend="thunderkittens")
    if batch == "bert-padded":
        with torch.no_grad():
            got = compiled(**inputs).last_hidden_state.float()
            want = net(**inputs).last_hidden_state.float()
        assert tk_inductor.report().replaced.get("attention") == 2, str(tk_inductor.report())
        tokens = inputs["attention_mask"].bool()
        assert rel_err(got[tokens], want[tokens]) < 2e-2
        return
    net.train()
    labels = ids.masked_fill(inputs["attention_mask"] == 0, -100) if "attention_mask" in inputs else ids
    assert trains_like_eager(net, compiled, **inputs, labels=labels) == 2, str(tk_inductor.report())


@pytest.mark.parametrize("N, D, window", [(1000, 64, 0), (333, 64, 128), (517, 128, 0)])
def test_sinks_under_padding(ops, N, D, window):
    """Attention sinks (gpt-oss) over a padded batch: tk::attention_varlen's o rescaled by σ(lse − sink), lse's
    gradient through the varlen backward kernel; against the dense fp32 softmax over [scores, sink] with the sink's
    column dropped. Rows that see no key (left padding, the empty entry) put all their mass on the sink: o = 0."""
    from tk_inductor.ops.attention_varlen import attention_varlen_adapter

    B, Hq, Hkv = 5, 8, 2
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(B, Hq, Hkv, N, N, D, torch.bfloat16, seed=N + D))
    sink = torch.randn(1, Hq, 1, 1, device="cuda", requires_grad=True)
    keep = keep_of(B, N, seed=N)
    scale = D ** -0.5
    o = attention_varlen_adapter(q, k, v, True, scale, window, 0.0, keep, 0, None, False, 0.0, 0, False, sink)
    i, j = torch.arange(N, device="cuda")[:, None], torch.arange(N, device="cuda")[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True) & keep[:, None, None, :]
    check_sinks(o, q, k, v, sink, allowed, scale)


def check_sinks(o, q, k, v, sink, allowed, scale):
    """o and the gradients of (q, k, v, sink) against the fp32 softmax over [scores, sink] under the bool mask
    `allowed` (broadcast to the scores), the sink's column dropped; no NaN anywhere."""
    B, Hq, N, _ = q.shape
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, sink), do)
    assert not any(torch.isnan(t).any() for t in (o, *grads))
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    sr = sink.detach().clone().requires_grad_()
    kf, vf = (t.repeat_interleave(Hq // k.shape[1], dim=1) for t in (kr, vr))
    s = (qr @ kf.transpose(-1, -2)) * scale
    s = torch.cat([s.masked_fill(~allowed, float("-inf")), sr.expand(B, Hq, N, 1)], -1)
    o_ref = torch.softmax(s, -1)[..., :-1] @ vf
    assert rel_err(o, o_ref) < OUT_TOL
    refs = torch.autograd.grad(o_ref, (qr, kr, vr, sr), do.float())
    for name, got, want in zip(("dq", "dk", "dv", "dsink"), grads, refs):
        assert rel_err(got, want) < GRAD_TOL, f"{name}: relative error {rel_err(got, want):.3e}"
