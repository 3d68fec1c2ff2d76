"""Attention family: the tk::attention ops (reference, autograd, opcheck, input errors), and on the GPU their kernel
paths."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tk_inductor.ops import attention as A

from attention_helpers import _qkv, _kernel_built

# ============================================================================ the ops

SHAPES = [  # B, Hq, Hkv, N, M, D
    (2, 4, 4, 7, 7, 16),
    (1, 4, 2, 5, 9, 8),   # GQA, N < M
    (2, 6, 3, 9, 4, 8),   # GQA, N > M
    (1, 4, 1, 1, 6, 16),  # MQA, one query
    (3, 2, 2, 6, 1, 8),   # one key
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_sdpa(shape, causal):
    B, Hq, Hkv, N, M, D = shape
    q, k, v = _qkv(*shape)
    scale = 0.37
    o, lse = torch.ops.tk.attention(q, k, v, causal, scale)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    # o is a (B, Hq, N, D) view of a (B, N, Hq, D) contiguous buffer; lse is fp32 (B, Hq, N) contiguous
    assert o.shape == (B, Hq, N, D) and o.transpose(1, 2).is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, N) and lse.is_contiguous()
    s = (q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(N, M, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_autograd(shape, causal):
    q, k, v = _qkv(*shape, dtype=torch.float32, grad=True)
    o, _ = torch.ops.tk.attention(q, k, v, causal, 0.5)
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        assert a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_low_precision_reference_accumulates_in_fp32():
    q, k, v = _qkv(2, 4, 2, 33, 40, 64, dtype=torch.float32)
    o, lse = torch.ops.tk.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), True, 0.125)
    ref = F.scaled_dot_product_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(),
                                         is_causal=True, scale=0.125, enable_gqa=True)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), ref, rtol=1e-2, atol=1e-2)
    assert (o.float() - ref).abs().max() <= ref.abs().max() * 2 ** -7  # bf16 rounding of the output only


def test_any_strides():
    q, k, v = _qkv(2, 4, 2, 5, 6, 8)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) storage
    o, _ = torch.ops.tk.attention(qt, k, v, True, 0.3)
    torch.testing.assert_close(o, torch.ops.tk.attention(q, k, v, True, 0.3)[0])


def test_empty_query():
    q, k, v = _qkv(2, 4, 2, 0, 6, 8)
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.3)
    assert o.shape == (2, 4, 0, 8) and lse.shape == (2, 4, 0)


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck(causal):
    q, k, v = _qkv(2, 4, 2, 5, 7, 8, dtype=torch.float32, grad=True)
    torch.library.opcheck(torch.ops.tk.attention.default, (q, k, v, causal, 0.3))
    o, lse = torch.ops.tk.attention(q.detach(), k.detach(), v.detach(), causal, 0.3)
    torch.library.opcheck(torch.ops.tk.attention_backward.default,
                          (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse, causal, 0.3))


def test_fake_strides_match_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv(2, 4, 2, 5, 7, 8, dtype=torch.float32)
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.3)
    with FakeTensorMode() as mode:
        fo, flse = torch.ops.tk.attention(*(mode.from_tensor(t) for t in (q, k, v)), True, 0.3)
    assert fo.stride() == o.stride() and flse.stride() == lse.stride()
    assert fo.shape == o.shape and flse.dtype == lse.dtype


@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "one_head"])
def test_backward_gradients_take_the_inputs_layout(layout):
    """dq/dk/dv are (B, N, H, D)-major when the inputs are (HF's projections, read by their backward without a copy),
    contiguous otherwise; the fake gives the same strides as the reference (and the kernel: grad_like)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv(2, 1 if layout == "one_head" else 4, 1 if layout == "one_head" else 2, 5, 7, 8, dtype=torch.float32)
    if layout != "bhnd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    o, lse = torch.ops.tk.attention(q, k, v, True, 0.3)
    do = torch.randn_like(o)
    grads = torch.ops.tk.attention_backward(do, q, k, v, o, lse, True, 0.3)
    with FakeTensorMode() as mode:
        fakes = torch.ops.tk.attention_backward(*(mode.from_tensor(t) for t in (do, q, k, v, o, lse)), True, 0.3)
    for g, f, like in zip(grads, fakes, (q, k, v)):
        assert g.stride() == f.stride() and g.shape == like.shape
        if layout == "bnhd":
            assert g.transpose(1, 2).is_contiguous() and not g.is_contiguous()
        else:
            assert g.is_contiguous()
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, scale=0.3, enable_gqa=True)
    for g, w in zip(grads, torch.autograd.grad(out, ref, do)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad, error, message", [
    (lambda q, k, v: (q[0], k, v), ValueError, "4-D"),
    (lambda q, k, v: (q, k.double(), v), TypeError, "dtypes differ"),
    (lambda q, k, v: (q, k, v.to("meta")), ValueError, "devices differ"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "floating"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)), ValueError,
     "multiple of key/value heads"),
    (lambda q, k, v: (q, k[..., :4], v[..., :4]), ValueError, "head dim"),
    (lambda q, k, v: (q, k, v[:, :, :2]), ValueError, r"same \(B, H, M\)"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "empty"),
])
def test_bad_inputs(bad, error, message):
    q, k, v = _qkv(2, 4, 2, 5, 6, 8, dtype=torch.float32)
    with pytest.raises(error, match=message):
        torch.ops.tk.attention(*bad(q, k, v), False, 0.5)


def test_bad_scale_and_backward_inputs():
    q, k, v = _qkv(2, 4, 2, 5, 6, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="finite"):
        torch.ops.tk.attention(q, k, v, False, math.inf)
    o, lse = torch.ops.tk.attention(q, k, v, False, 0.5)
    with pytest.raises(ValueError, match="lse shape"):
        torch.ops.tk.attention_backward(o, q, k, v, o, lse[:, :2], False, 0.5)
    with pytest.raises(TypeError, match="lse must be float32"):
        torch.ops.tk.attention_backward(o, q, k, v, o, lse.double(), False, 0.5)
    with pytest.raises(ValueError, match="grad_o shape"):
        torch.ops.tk.attention_backward(o[:, :, :2], q, k, v, o, lse, False, 0.5)


def test_kernel_supports():
    assert A.kernel_supports(torch.bfloat16, 128) is None
    assert A.kernel_supports(torch.float16, 64) is None
    assert "dtype" in A.kernel_supports(torch.float32, 64)
    assert A.kernel_supports(torch.bfloat16, 96) is None and A.kernel_supports(torch.bfloat16, 80) is None
    assert "head dim 112" in A.kernel_supports(torch.bfloat16, 112)  # the kernels run it, unmeasured: not routed
    assert A.kernel_supports(torch.bfloat16, 256) is None and A.kernel_supports(torch.float16, 192) is None
    assert A.kernel_supports(torch.bfloat16, 256, backward=True) is None
    assert A.kernel_supports(torch.bfloat16, 128, backward=True) is None
    assert "head dim 320" in A.kernel_supports(torch.bfloat16, 320)


# ============================================================================ on the GPU (skipped without CUDA)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_op_uses_kernel_and_autograd(causal):
    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in _qkv(2, 8, 2, 300, 257, 128, dtype=torch.float32))
    assert A._kernel_ok(q, k, v)
    o, lse = torch.ops.tk.attention(q, k, v, causal, 0.0883)
    ref_o, ref_lse = A.attention_reference(q.detach(), k.detach(), v.detach(), causal, 0.0883)
    assert not o.isnan().any()
    assert (o.float() - ref_o.float()).norm() / ref_o.float().norm() < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    want = A.attention_backward_reference(do, q.detach(), k.detach(), v.detach(), o.detach(), lse, causal, 0.0883)
    for g, w in zip(grads, want):
        assert (g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-3) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_unsupported_inputs_fall_back_to_reference():
    q, k, v = (t.cuda() for t in _qkv(1, 4, 4, 33, 33, 64, dtype=torch.float32))
    o, _ = torch.ops.tk.attention(q, k, v, True, 0.125)  # fp32: no kernel, the reference runs
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125),
                               rtol=1e-5, atol=1e-5)
