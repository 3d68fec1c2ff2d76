"""GPU tests of the split-KV decode kernels (csrc/kernels/attention/decode.cu): tk_cuda::attention with at most 16
query rows, against the fp32 reference. Skipped without CUDA.

The cases cover one and several splits (short and long caches), every row-tile count (a GQA group's rows G·N of
at most 16, 32 and 64, and more than 64: several row groups), head dims below the compiled 64/128, causal, window
and softcapped scores, strided (B, N, H, D) views, padding masks through tk::attention_varlen (rows without keys),
CUDA-graph capture, and the backward on the decode forward's lse.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import tk_inductor.ops.attention_masked as A  # registers the tk:: ops
from test_attention_gpu import (GRAD_TOL, OUT_TOL, check_forward, make_inputs, ops, poison, reference,  # noqa: F401
                                rel_err, replays_in_cuda_graph)
from test_attention_varlen_gpu import check_sinks, keep_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cases():
    out = []
    lengths = (1, 63, 1000, 4097, 33000)
    heads = ((32, 8), (8, 8), (16, 1), (4, 2), (40, 5))  # G = 4, 1, 16 (R > 64 at N 5), 2, 8
    for i, (N, M) in enumerate(itertools.product((1, 2, 5, 16), lengths)):
        Hq, Hkv = heads[i % len(heads)]
        D = (128, 64, 80, 32)[i % 4]
        dtype = (torch.bfloat16, torch.float16)[(i // 2) % 2]
        scores = ("full", "causal", "window", "cap")[(i // 3) % 4]
        out.append(((1, 3)[i % 2], Hq, Hkv, N, M, D, dtype, scores, ("bhnd", "bnhd")[(i // 5) % 2]))
    return out


def _id(c):
    B, Hq, Hkv, N, M, D, dtype, scores, layout = c
    return f"B{B}-H{Hq}:{Hkv}-N{N}-M{M}-D{D}-{str(dtype)[6:]}-{scores}-{layout}"


def _scores(kind, D):
    causal = kind in ("causal", "window")
    return causal, (3 if kind == "window" else 0), (20.0 if kind == "cap" else 0.0), 1.0 / math.sqrt(D)


@pytest.mark.parametrize("case", cases(), ids=_id)
def test_decode_forward(ops, case):
    B, Hq, Hkv, N, M, D, dtype, kind, layout = case
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, dtype, layout=layout, seed=N + M)
    causal, window, cap, scale = _scores(kind, D)
    check_forward(ops, q, k, v, causal, scale, window, cap)


@pytest.mark.parametrize("N", [1, 4])
def test_decode_padding_masks(ops, N):
    """Left/right padding, an entry without keys (o = 0, lse = +inf) and random ranges, through tk::attention_varlen
    (its interval tables), at one and several splits."""
    for M in (300, 20000):
        B, Hq, Hkv, D = 6, 32, 8, 128
        q, k, v = make_inputs(B, Hq, Hkv, N, M, D, torch.bfloat16, layout="bnhd", seed=M)
        keep = keep_of(B, M, seed=M)
        o, lse = torch.ops.tk.attention_varlen(q, k, v, keep, None, False, 0.1)
        o_ref, lse_ref = reference(q, k, v, False, 0.1, keep=keep)
        assert rel_err(o, o_ref) < OUT_TOL
        seen = torch.isfinite(lse_ref)
        assert torch.equal(torch.isinf(lse) & (lse > 0), ~seen), "rows without keys: lse +inf"
        assert torch.equal(o[~seen], torch.zeros_like(o[~seen]))
        torch.testing.assert_close(lse[seen], lse_ref[seen], atol=2e-3, rtol=1e-4)


def test_decode_in_cuda_graph(ops):
    """Captured and replayed with new inputs (a static-cache decode step under CUDA graphs): the partials come from
    the graph's pool and every replay merges them again."""
    replays_in_cuda_graph(ops, (2, 32, 8, 1, 9000, 128, torch.bfloat16), False, (1, 2, 3))


@pytest.mark.parametrize("N,M,causal", [(1, 5000, False), (7, 700, True), (16, 2049, False)])
def test_decode_backward(ops, N, M, causal):
    """Short queries in training (the backward kernels on the decode forward's o and lse)."""
    B, Hq, Hkv, D = 2, 8, 2, 64
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(B, Hq, Hkv, N, M, D, torch.bfloat16, seed=N))
    o, _ = torch.ops.tk.attention(q, k, v, causal, 0.125)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference(qr, kr, vr, causal, 0.125)
    assert rel_err(o, o_ref) < OUT_TOL
    want = torch.autograd.grad(o_ref, (qr, kr, vr), do.float())
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(g, r) < GRAD_TOL, name


@pytest.mark.parametrize("cache, padded", [("dynamic", False), ("dynamic", True), ("static", True)])
def test_hf_generate_with_the_kernels(cache, padded):
    """generate() of an HF Llama (bf16, head dim 64, GQA 8:2) with a compiled forward (dynamic shapes): the tokens
    and logits are eager's; the prefill runs the attention kernels and the decode steps the split-KV ones where they
    are replaced. A left-padded batch reads its mask at run time (tk::attention_varlen); a static
    cache's prefill and decode steps write the buffer in place and attend over it under a run-time mask of one run
    of keys per row, none for the prefill's padded rows (tk::attention_masked's interval tables)."""
    transformers = pytest.importorskip("transformers")
    import tk_inductor

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(1, 128, (2, 300), device="cuda")
    am = torch.ones_like(ids)
    if padded:
        am[0, :100] = 0
    kw = dict(attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_logits=True, cache_implementation=cache)
    want = model.generate(ids, **kw)
    tk_inductor.reset()
    A.masked_paths.clear()
    model.forward = torch.compile(model.forward, backend="thunderkittens", options={"strict": True}, dynamic=True)
    got = model.generate(ids, **kw)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert rel_err(a, b) < 2e-2, f"step {step}: logits differ by {rel_err(a, b):.3e}"
    assert torch.equal(got.sequences, want.sequences)
    # The prefill graph replaces both layers. A decode step is replaced where its SDPA has a mask (torch before 2.14,
    # where transformers always builds one, or padding: K/V repeated per query head) and left to SDPA's own split-KV
    # path otherwise (no mask: enable_gqa).
    graphs = tk_inductor.report().graphs
    assert len(graphs) >= 2 and graphs[0].replaced.get("attention", 0) == 2, graphs
    for g in graphs[1:]:
        kept = [why for family, why in g.kept if family == "attention"]
        assert g.replaced.get("attention", 0) + len(kept) == 2 and all("grouped-query path" in w for w in kept), g
    if padded:
        assert all(g.replaced.get("attention", 0) == 2 for g in graphs), graphs
    if cache == "static":  # its masks (the prefill's padded rows see no key; one run of keys per row) run the kernels
        assert A.masked_paths.get("sdpa", 0) == 0 and A.masked_paths.get("intervals", 0) > 0, dict(A.masked_paths)


@pytest.mark.parametrize("N, M, kind", [(1, 1000, "causal"), (5, 333, "runs"), (300, 300, "causal"), (64, 517, "runs"),
                                        (16, 700, "window")])
def test_sinks_under_a_mask_handed_in(ops, N, M, kind):
    """gpt-oss's sinks under a mask handed into the graph (a decode step's against a cache): tk::attention_masked's
    o and lse on the kernels (causal, or a sliding cache's window: tk::attention at the cache's offset; one run of
    keys per row: the interval tables), rescaled by σ(lse − sink), lse's gradient through the raw backward; forward
    and every gradient against the fp32 softmax over [scores, sink] (check_sinks)."""
    B, Hq, Hkv, D = 2, 8, 2, 64
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(B, Hq, Hkv, N, M, D, torch.bfloat16, seed=N + M))
    sink = torch.randn(1, Hq, 1, 1, device="cuda", requires_grad=True)
    i = torch.arange(N, device="cuda")[:, None] + (M - N)  # the queries are the cache's last N positions
    j = torch.arange(M, device="cuda")[None, :]
    allowed = j <= i
    if kind == "window":
        allowed = allowed & (j > i - 40)
    if kind == "runs":  # each row one run of keys, not a kernel kind
        allowed = allowed & (j >= i // 2)
    scale = D ** -0.5
    A.masked_paths.clear()
    o = A.attention_masked_sink_adapter(q, k, v, allowed, scale, 0.0, sink)
    assert A.masked_paths.get("sdpa", 0) == 0 and A.masked_paths.get("reference", 0) == 0, dict(A.masked_paths)
    check_sinks(o, q, k, v, sink, allowed, scale)
