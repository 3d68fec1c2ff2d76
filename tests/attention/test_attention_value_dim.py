"""tk::attention with a value head dim other than q's and k's (multi-head latent attention: DeepSeek-V2/V3 and Kimi-K2
use 192 for q/k and 128 for v): the reference against SDPA, the kernel path with the raw kernels stood in for by the
reference behind their own limit (one head dim), and the matcher on an MLA-style layer and HF's DeepSeek-V3."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tk_inductor
from tk_inductor.ops import _dispatch
from tk_inductor.ops import attention as A

OPTS = {"reference": True, "inner": "aot_eager"}


def _qkv(B, Hq, Hkv, N, M, D, Dv, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, M, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, M, Dv, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("D, Dv", [(24, 16), (8, 20)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_sdpa(D, Dv, causal):
    q, k, v = _qkv(2, 4, 2, 7, 9, D, Dv, grad=True)
    o, lse = torch.ops.tk.attention(q, k, v, causal, 0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
    assert o.shape == (2, 4, 7, Dv) and o.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # P from the fp32 lse


def test_checks():
    q, k, v = _qkv(1, 2, 2, 3, 3, 16, 8)
    with pytest.raises(ValueError, match=r"same \(B, H, M\)"):
        torch.ops.tk.attention(q, k, v[:, :, :2], False, 0.5)
    with pytest.raises(ValueError, match="head dim of k/v"):
        torch.ops.tk.attention(q, k[..., :8], v, False, 0.5)
    o, lse = torch.ops.tk.attention(q, k, v, False, 0.5)
    with pytest.raises(ValueError, match=r"grad_o shape .* must be \(B, Hq, N, Dv\)"):
        torch.ops.tk.attention_backward(o[..., :4], q, k, v, o, lse, False, 0.5)
    # the masked op takes one head dim
    with pytest.raises(ValueError, match="must have the same shape"):
        torch.ops.tk.attention_masked(q, k, v, torch.ones(3, 3, dtype=torch.bool), 0.5)


class RawStandIns:
    """tk_cuda::attention / attention_backward as the reference, refusing what the kernels refuse (one head dim for
    q, k and v); `dims` records the head dims each call got."""

    def __init__(self):
        self.dims = []

    def attention(self, q, k, v, causal, scale, window, softcap, dropout_p, rng):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1]
        self.dims.append(q.shape[-1])
        return A.attention_reference(q, k, v, causal, scale, window, softcap, None, dropout_p, rng)

    def attention_backward(self, grad_o, q, k, v, o, lse, causal, scale, window, softcap, dropout_p, rng, grad_lse):
        assert q.shape[-1] == v.shape[-1] == o.shape[-1] == grad_o.shape[-1]
        self.dims.append(q.shape[-1])
        return A.attention_backward_reference(grad_o, q, k, v, o, lse, causal, scale, None, window, softcap,
                                              dropout_p, rng, grad_lse=grad_lse)


@pytest.mark.parametrize("D, Dv", [(192, 128), (64, 96)])
def test_kernel_path_pads_to_one_head_dim(monkeypatch, D, Dv):
    raw = RawStandIns()
    monkeypatch.setattr(_dispatch, "use_kernel", lambda family, *tensors: True)
    monkeypatch.setattr(_dispatch, "kernel", lambda name: getattr(raw, name))
    q, k, v = (t.bfloat16().requires_grad_() for t in _qkv(1, 4, 2, 33, 40, D, Dv, dtype=torch.float32))
    o, lse = torch.ops.tk.attention(q, k, v, True, D ** -0.5)
    assert o.shape == (1, 4, 33, Dv) and o.transpose(1, 2).is_contiguous() and o.dtype == torch.bfloat16
    want_o, want_lse = A.attention_reference(q, k, v, True, D ** -0.5)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(lse, want_lse)
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), g)
    want = A.attention_backward_reference(g, q.detach(), k.detach(), v.detach(), want_o, want_lse, True, D ** -0.5)
    for a, b, t in zip(got, want, (q, k, v)):
        assert a.shape == t.shape
        torch.testing.assert_close(a, b)
    assert raw.dims == [max(D, Dv)] * 2
    assert A.kernel_supports(torch.bfloat16, max(D, Dv)) is None


def test_the_raw_op_is_not_called_directly_with_two_head_dims():
    """The post-grad pass calls the raw op in place of the Python op only where it takes the operands as they are."""
    q, k, v = (t.bfloat16() for t in _qkv(1, 4, 2, 33, 40, 192, 128, dtype=torch.float32))
    assert not A.direct_kernel_ok(q, k, v)


class MLA(torch.nn.Module):
    """Multi-head latent attention's score and value heads as DeepSeek's layer shapes them: q and k of a
    no-position part and a rotary part concatenated (here without the rotation), v with its own head dim."""

    def __init__(self, hidden=64, heads=4, nope=16, rope=8, v_dim=16):
        super().__init__()
        self.h, self.nope, self.rope, self.v_dim = heads, nope, rope, v_dim
        self.q = torch.nn.Linear(hidden, heads * (nope + rope), bias=False)
        self.kv = torch.nn.Linear(hidden, heads * (nope + v_dim), bias=False)
        self.k_rope = torch.nn.Linear(hidden, rope, bias=False)
        self.o = torch.nn.Linear(heads * v_dim, hidden, bias=False)

    def forward(self, x):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.h, -1).transpose(1, 2)
        kv = self.kv(x).view(B, N, self.h, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = self.k_rope(x).view(B, 1, N, self.rope).expand(B, self.h, N, self.rope)
        k = torch.cat([k_nope, k_pe], dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(self.nope + self.rope) ** -0.5)
        return self.o(o.transpose(1, 2).reshape(B, N, -1))


def test_mla_layer_is_replaced_and_trains():
    torch.manual_seed(0)
    model = MLA()
    x = torch.randn(2, 12, 64, requires_grad=True)
    tk_inductor.reset()
    torch._dynamo.reset()
    out = torch.compile(model, backend="thunderkittens", options=OPTS)(x)
    assert tk_inductor.report().replaced.get("attention") == 1, tk_inductor.report().kept
    want = model(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (x, *model.parameters()), g),
                    torch.autograd.grad(want, (x, *model.parameters()), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dims, kept", [((24, 8, 16), "cuDNN backend runs it natively"),
                                        ((104, 8, 64), "cuDNN backend runs it natively")])
def test_kernel_checks_on_cuda_graphs(dims, kept):
    """On CUDA (fake example values, reference mode off) an SDPA call with two head dims stays with SDPA, whose cuDNN
    backend runs them natively and measured faster than the kernels on zero-padded heads (the eager spelling, which
    Inductor would run with materialised scores, is replaced: CPU tests above)."""
    from dynamo_tracing import to_fake_cuda
    from tk_inductor import config
    from tk_inductor.patterns import attention

    nope, rope, v_dim = dims
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    model = MLA(nope=nope, rope=rope, v_dim=v_dim).bfloat16()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(torch.randn(1, 24, 64, dtype=torch.bfloat16))
    to_fake_cuda(graphs[0].graph)
    matches = list(attention.find(graphs[0].graph, config.current({"reference": False})))
    assert len(matches) == 1
    if kept is None:
        assert matches[0].reason is None, matches[0].reason
    else:
        assert kept in matches[0].reason, matches[0].reason
