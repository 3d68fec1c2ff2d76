"""The chunked spelling of causal linear attention (patterns/_chunked.py): replaced by tk::linear_attention and equal
to eager in reference mode (CPU), forward and gradients; near misses (an inclusive prefix, scales that disagree, the
mask's diagonal, a chunk merged out of order) are left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynamo_tracing import rewritten

try:  # FLA's naive spelling uses einops (the test extra)
    import einops
except ImportError:
    einops = None

OPTIONS = {"reference": True, "inner": "aot_eager"}


def causal_chunk_mask(c, device):
    return torch.triu(torch.ones(c, c, dtype=torch.bool, device=device), diagonal=1)


def heads_first(q, k, v, scale=0.25, chunk=16, prefix="cat", feature_map=None, hedgehog=None, diagonal=1,
                in_order=True):
    """(B, H, N, d) inputs chunked by view, the exclusive prefix by cat or by cumsum - kv; in_order=False merges the
    output's (n, c) as (c, n) (not the op's token order)."""
    B, H, N, d = q.shape
    if feature_map == "elu1":
        q, k = F.elu(q) + 1, F.elu(k) + 1
    elif feature_map == "hedgehog":
        q, k = (torch.cat([z.softmax(-1), (-z).softmax(-1)], -1) for z in (q @ hedgehog[0], k @ hedgehog[1]))
    f = q.shape[-1]
    q = q.view(B, H, N // chunk, chunk, f) * scale
    k = k.view(B, H, N // chunk, chunk, f)
    v = v.view(B, H, N // chunk, chunk, v.shape[-1])
    kv = k.transpose(-1, -2) @ v
    total = kv.cumsum(2)
    state = torch.cat([torch.zeros_like(kv[:, :, :1]), total[:, :, :-1]], dim=2) if prefix == "cat" else \
        total - kv if prefix == "sub" else total  # "inclusive": not linear attention
    inter = q @ state
    mask = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=diagonal)
    intra = (q @ k.transpose(-1, -2)).masked_fill(mask, 0) @ v
    o = intra + inter
    return o.reshape(B, H, N, -1) if in_order else o.transpose(2, 3).reshape(B, H, N, -1)


def fla_naive(q, k, v, scale=0.25, chunk=16):
    """FLA's naive_chunk_linear_attn (unnormalised), tokens-first with einops and an in-place mask."""
    q = einops.rearrange(q, "b (n c) h d -> b h n c d", c=chunk) * scale
    k = einops.rearrange(k, "b (n c) h d -> b h n c d", c=chunk)
    v = einops.rearrange(v, "b (n c) h d -> b h n c d", c=chunk)
    kv = k.transpose(-1, -2) @ v
    kv = kv.cumsum(2)
    kv = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], dim=2)
    inter = q @ kv
    intra = ((q @ k.transpose(-1, -2)).masked_fill_(causal_chunk_mask(q.shape[3], q.device), 0)) @ v
    o = inter + intra
    return einops.rearrange(o, "b h n c d -> b (n c) h d")


def tokens_first_by_hand(q, k, v, scale=0.5, chunk=8, scale_inter=None):
    """(B, N, H, d) inputs chunked by reshape + permute, merged back by permute + reshape; scale_inter: a different
    scale on the inter-chunk term (not linear attention)."""
    B, N, H, d = q.shape

    def chunks(x):
        return x.reshape(B, N // chunk, chunk, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    kv = kc.transpose(-1, -2) @ vc
    inter = (qc * (scale if scale_inter is None else scale_inter)) @ (kv.cumsum(2) - kv)
    intra = ((qc * scale) @ kc.transpose(-1, -2)).masked_fill(causal_chunk_mask(chunk, q.device), 0) @ vc
    return (inter + intra).permute(0, 2, 3, 1, 4).reshape(B, N, H, -1)


def run(fn, *inputs):
    """(report, the op's (feature_map, ..., scale) arguments, compiled output) for fn compiled with the rewrite."""
    return rewritten(fn, inputs, OPTIONS, torch.ops.tk.linear_attention.default, lambda n: n.args[3:])


def check_replaced_and_equal(fn, inputs, feature_map="identity", scale=0.25):
    report, ops, out = run(fn, *inputs)
    assert report.replaced.get("linear_attention") == 1, report
    fm, _, _, op_scale, normalize, _ = ops[0]
    assert fm == feature_map and op_scale == pytest.approx(scale) and not normalize
    want = fn(*inputs)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    leaves = [t for t in inputs if t.requires_grad]
    grad = torch.randn_like(out)
    for got, ref in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def _qkv(*shape, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [shape, shape, (*shape[:-1], dv or shape[-1])]
    return [torch.randn(*s, generator=g, ).requires_grad_() for s in sizes]


@pytest.mark.parametrize("prefix", ["cat", "sub"])
@pytest.mark.parametrize("feature_map", ["identity", "elu1", "hedgehog"])
def test_heads_first_chunked_is_replaced_and_equal(prefix, feature_map):
    q, k, v = _qkv(2, 3, 64, 8, dv=6)
    g = torch.Generator().manual_seed(1)
    w = [(torch.randn(8, 4, generator=g) / 3).requires_grad_() for _ in range(2)]
    inputs = (q, k, v, *w) if feature_map == "hedgehog" else (q, k, v)

    def fn(q, k, v, *w):
        return heads_first(q, k, v, prefix=prefix, feature_map=feature_map, hedgehog=w)

    check_replaced_and_equal(fn, inputs, feature_map)


@pytest.mark.skipif(einops is None, reason="needs einops")
def test_fla_naive_chunk_linear_attn_is_replaced_and_equal():
    from dynamo_tracing import einops_stays_one_op

    if einops_stays_one_op():
        pytest.skip("this torch's Dynamo keeps einops calls as single graph ops (torch 2.11 does); the matcher reads "
                    "the torch ops they trace to")
    check_replaced_and_equal(fla_naive, _qkv(2, 64, 3, 8))


def test_tokens_first_by_reshape_and_permute():
    check_replaced_and_equal(tokens_first_by_hand, _qkv(2, 40, 3, 8, dv=5), scale=0.5)


@pytest.mark.parametrize("near_miss", ["inclusive prefix", "diagonal 0", "scales differ"])
def test_near_misses_are_not_replaced(near_miss):
    q, k, v = _qkv(2, 3, 64, 8)
    if near_miss == "scales differ":
        fn, inputs = (lambda q, k, v: tokens_first_by_hand(q, k, v, scale_inter=0.25)), _qkv(2, 40, 3, 8)
    else:
        fn = (lambda q, k, v: heads_first(q, k, v, prefix="inclusive")) if near_miss == "inclusive prefix" else \
            (lambda q, k, v: heads_first(q, k, v, diagonal=0))  # hides the diagonal too
        inputs = (q, k, v)
    report, ops, out = run(fn, *inputs)
    assert "linear_attention" not in report.replaced and not ops
    torch.testing.assert_close(out, fn(*inputs))


def test_dynamic_lengths_with_a_literal_chunk():
    """dynamic=True: the chunk count is N // c, symbolic; one graph, replaced, serves every length."""
    import tk_inductor

    def fn(q, k, v):
        return heads_first(q, k, v, 0.25, 16)

    tk_inductor.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="thunderkittens", options=OPTIONS, dynamic=True)
    for n in (64, 96, 160):
        q, k, v = _qkv(2, 3, n, 8)
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=1e-4, atol=1e-5)
    assert tk_inductor.report().replaced.get("linear_attention") == 1, tk_inductor.report()


def test_chunks_merged_out_of_order_are_not_replaced():
    q, k, v = _qkv(2, 3, 64, 8)
    report, ops, out = run(lambda q, k, v: heads_first(q, k, v, in_order=False), q, k, v)
    assert "linear_attention" not in report.replaced and not ops
    torch.testing.assert_close(out, heads_first(q, k, v, in_order=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("feature_map", ["identity", "elu1"])
def test_chunked_spelling_trains_on_the_kernels(feature_map):
    """On CUDA in bf16 the chunked spelling runs the kernels (dk 64, dv 64), forward and backward, and follows fp32
    eager."""
    import tk_inductor

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(3))

    def fn(q, k, v):
        return heads_first(q, k, v, scale=0.125, chunk=64, feature_map=feature_map)

    tk_inductor.reset()
    torch._dynamo.reset()
    out = torch.compile(fn, backend="thunderkittens")(q, k, v)
    assert tk_inductor.report().replaced.get("linear_attention") == 1, tk_inductor.report()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = fn(*leaves)
    do = torch.randn(want.shape, device="cuda", generator=g)
    out.backward(do.bfloat16())
    want.backward(do)

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert rel(out, want) < 2e-2
    for got, ref in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        assert rel(got, ref) < 3e-2
