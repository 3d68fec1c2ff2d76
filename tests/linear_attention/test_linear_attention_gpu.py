"""The linear-attention kernels (csrc/kernels/linear_attention: Based in based.cu / based_backward.cu, the plain maps
identity and elu1 in plain.cu / plain_backward.cu, Hedgehog's forward in hedgehog.cu) against the fp32 chunked reference and its autograd, through the
raw ops tk_cuda::linear_attention and tk_cuda::linear_attention_backward, on random bf16 inputs: odd lengths (chunk
tails), one and several chunks, dk 64 and 128 (plain), dv 64 and 128 (one and two value tiles per head), normalised or
not, strided inputs, and outputs poisoned before each call."""
from __future__ import annotations

import math

import pytest
import torch

from tk_inductor.ops import linear_attention as la

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = (1, 17, 64, 65, 200, 1000, 4096)
TOL = 1e-2  # relative (norm-wise) error vs fp32


@pytest.fixture(scope="module")
def ops():
    from tk_inductor import build

    build.load("linear_attention")
    return torch.ops.tk_cuda


def poison(shape):
    """A NaN block of the output's size, freed just before the call: the allocator hands it to the op, so any
    element the kernel fails to write stays NaN."""
    junk = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk


def inputs(B, H, N, dv, layout="bhnd", seed=0, dk=16, positive=False):
    """q, k (B, H, N, dk) and v (B, H, N, dv); positive: |q|, |k| (features already mapped, as identity's normalised
    form is used: a denominator that crosses zero is no test of the kernel)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(B, H, N, dk), (B, H, N, dk), (B, H, N, dv)]
    if layout == "bnhd":  # (B, N, H, d) buffers seen head-first, as a model's projections give them
        ts = [torch.randn(b, n, h, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
              for b, h, n, d in shapes]
    else:
        ts = [torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16) for s in shapes]
    if positive:
        ts[0], ts[1] = ts[0].abs(), ts[1].abs()
    return ts


def plain_inputs(fm, B, H, N, dv, dk, normalize, seed=0, layout="bhnd"):
    return inputs(B, H, N, dv, layout, seed, dk, positive=fm == "identity" and normalize)


def heads(grid: str, B: int = 2, dv: int = 64) -> int:
    """H whose grid of 64-column blocks (B·H·dv/64) is "small" (a few blocks: most SMs idle) or "wide" (more than
    half the SMs' blocks, so the backward's two scans, one grid, exceed the SMs)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return 3 if grid == "small" else (sms // 2) // (B * (dv // 64)) + 1


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)).item()


def check(ops, q, k, v, scale, normalize, eps=1e-6, fm="based"):
    B, H, N, dv = v.shape
    poison((B, H, N, dv))
    o = ops.linear_attention(q, k, v, fm, None, None, scale, normalize, eps)
    torch.cuda.synchronize()
    assert o.shape == v.shape and o.dtype == torch.bfloat16 and o.is_contiguous()
    assert not o.isnan().any(), "unwritten or non-finite outputs"
    want = la.linear_attention_reference(q, k, v, fm, None, None, scale, normalize, eps).float()
    err = rel_err(o, want)
    assert err < TOL, f"relative error {err:.3g} ({fm} B{B} H{H} N{N} dk{q.shape[-1]} dv{dv} normalize={normalize})"


@pytest.mark.parametrize("grid", ["wide", "small"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dv", [64, 128])
@pytest.mark.parametrize("N", LENGTHS)
def test_based_forward(ops, N, dv, normalize, grid):
    q, k, v = inputs(2, heads(grid, 2, dv), N, dv, seed=N + dv)
    check(ops, q, k, v, 1 / math.sqrt(16), normalize)


@pytest.mark.parametrize("scale", [0.05, 0.5])
def test_based_forward_other_scales(ops, scale):
    q, k, v = inputs(1, 2, 333, 64, seed=5)
    check(ops, q, k, v, scale, True)
    check(ops, q, k, v, scale, False)


def test_based_forward_strided_inputs(ops):
    """(B, N, H, d) buffers transposed to head-first: read in place (row strides of H·d)."""
    q, k, v = inputs(2, 4, 300, 64, layout="bnhd", seed=9)
    assert not q.is_contiguous()
    check(ops, q, k, v, 0.25, True)


@pytest.mark.parametrize("B,H,dv", [(4, 16, 64), (4, 32, 128), (8, 40, 128)], ids=["64", "256", "640"])
def test_based_forward_many_heads(ops, B, H, dv):
    """A model's head shape (the benchmark's Based layer is B4 H16 N4096 dv64: 64 blocks of 64 columns), and
    grids of one and several waves of two blocks per SM."""
    q, k, v = inputs(B, H, 1024, dv, seed=11)
    check(ops, q, k, v, 0.25, True)


@pytest.mark.parametrize("grid", ["wide", "small"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 64), (64, 128), (128, 128)])
@pytest.mark.parametrize("N", LENGTHS)
@pytest.mark.parametrize("fm", ["elu1", "identity"])
def test_plain_forward(ops, fm, N, dk, dv, normalize, grid):
    q, k, v = plain_inputs(fm, 2, heads(grid, 2, dv), N, dv, dk, normalize, seed=N + dk + dv)
    check(ops, q, k, v, dk ** -0.5, normalize, fm=fm)


def test_plain_forward_strided_and_scales(ops):
    q, k, v = inputs(2, 4, 300, 64, layout="bnhd", seed=19, dk=128)
    assert not q.is_contiguous()
    check(ops, q, k, v, 0.3, True, fm="elu1")
    check(ops, q, k, v, 0.05, False, fm="identity")
    check(ops, q, k, v, 1.0, True, eps=1.0, fm="elu1")


def test_kernels_reject_what_they_do_not_compute(ops):
    q, k, v = inputs(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="feature dim must be 64 or 128"):
        ops.linear_attention(q, k, v, "identity", None, None, 1.0, False, 0.0)
    with pytest.raises(RuntimeError, match="not 'relu'"):
        ops.linear_attention(q, k, v, "relu", None, None, 1.0, False, 0.0)
    q64, k64 = torch.randn_like(v), torch.randn_like(v)
    with pytest.raises(RuntimeError, match="needs q_weight and k_weight"):
        ops.linear_attention(q64, k64, v, "hedgehog", None, None, 1.0, False, 0.0)
    with pytest.raises(RuntimeError, match="f 32 or 64"):
        w = torch.randn(64, 48, device="cuda")
        ops.linear_attention(q64, k64, v, "hedgehog", w, w, 1.0, False, 0.0)
    with pytest.raises(RuntimeError, match="no Hedgehog kernel"):
        w = torch.randn(64, 32, device="cuda")
        ops.linear_attention_backward(v, q64, k64, v, v, "hedgehog", w, w, 1.0, False, 0.0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_attention(q.half(), k.half(), v.half(), "based", None, None, 1.0, False, 0.0)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.linear_attention(q, k, v[..., :48], "based", None, None, 1.0, False, 0.0)
    with pytest.raises(RuntimeError, match="feature dim"):
        ops.linear_attention(q[..., :8], k[..., :8], v, "based", None, None, 1.0, False, 0.0)


def hedgehog_weights(H, dk, f, per_head, seed, dtype=torch.float32):
    """Wq, Wk of (H, dk, f) or (dk, f), entries ~ 1/√dk (the scores z = x W ~ 1, as a trained map's), bf16-exact."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (H, dk, f) if per_head else (dk, f)
    return [(torch.randn(shape, device="cuda", generator=g) / math.sqrt(dk)).to(torch.bfloat16).to(dtype)
            for _ in range(2)]


def check_hedgehog(ops, q, k, v, wq, wk, scale, normalize, eps=1e-6):
    B, H, N, dv = v.shape
    poison((B, H, N, dv))
    o = ops.linear_attention(q, k, v, "hedgehog", wq, wk, scale, normalize, eps)
    torch.cuda.synchronize()
    assert o.shape == v.shape and o.dtype == torch.bfloat16 and o.is_contiguous()
    assert not o.isnan().any(), "unwritten or non-finite outputs"
    want = la.linear_attention_reference(q, k, v, "hedgehog", wq.float(), wk.float(), scale, normalize, eps).float()
    err = rel_err(o, want)
    assert err < TOL, f"relative error {err:.3g} (hedgehog B{B} H{H} N{N} dk{q.shape[-1]} f{wq.shape[-1]} dv{dv} " \
                      f"normalize={normalize})"


@pytest.mark.parametrize("weights", ["per_head", "shared"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dk,f", [(64, 32), (64, 64), (128, 32), (128, 64)])
@pytest.mark.parametrize("N", LENGTHS)
def test_hedgehog_forward(ops, N, dk, f, normalize, weights):
    grid = "small" if N % 2 else "wide"
    q, k, v = inputs(2, heads(grid), N, 64, seed=N + dk + f, dk=dk)
    wq, wk = hedgehog_weights(q.shape[1], dk, f, weights == "per_head", seed=N)
    check_hedgehog(ops, q, k, v, wq, wk, (2 * f) ** -0.5, normalize)


def test_hedgehog_forward_strided_wide_values_and_bf16_weights(ops):
    q, k, v = inputs(2, 4, 300, 128, layout="bnhd", seed=31, dk=128)
    assert not q.is_contiguous()
    wq, wk = hedgehog_weights(4, 128, 64, True, seed=32)
    check_hedgehog(ops, q, k, v, wq, wk, 0.125, True)
    check_hedgehog(ops, q, k, v, wq.bfloat16(), wk.bfloat16(), 1.0, False)  # the op takes any float weights
    wq, wk = hedgehog_weights(4, 128, 32, False, seed=33)
    check_hedgehog(ops, q, k, v, wq, wk, 0.5, True, eps=1.0)


@pytest.mark.parametrize("per_head", [True, False], ids=["per_head", "shared"])
@pytest.mark.parametrize("dk,f", [(64, 32), (64, 64), (128, 32), (128, 64)])
@pytest.mark.parametrize("N", (1, 100, 1000))
def test_hedgehog_map_kernels(ops, N, dk, f, per_head):
    """The backward's map kernels: φ (tk_cuda::hedgehog_features) and, from dφ, dx and dz = the gradient of x W
    (tk_cuda::hedgehog_features_backward), against the reference map's fp32 autograd; x strided."""
    x = inputs(2, 3, N, 64, layout="bnhd", seed=N + dk + f, dk=dk)[0]
    w = hedgehog_weights(3, dk, f, per_head, seed=N)[0]
    poison((2, 3, N, 2 * f))
    phi = ops.hedgehog_features(x, w)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float()
    z = (torch.einsum("bhnd,hdf->bhnf", xr, wr) if per_head else xr @ wr).detach().requires_grad_()
    want = torch.cat([z.softmax(-1), (-z).softmax(-1)], -1)
    assert phi.shape == want.shape and phi.dtype == torch.bfloat16 and rel_err(phi, want) < TOL
    dphi = torch.randn(want.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)).bfloat16()
    poison(x.shape)
    dx, dz = ops.hedgehog_features_backward(dphi, x, w)
    want.backward(dphi.float())
    want_dx = z.grad @ (wr.transpose(-1, -2))
    assert dz.shape == z.shape and dx.shape == x.shape and dx.dtype == dz.dtype == torch.bfloat16
    assert not dx.isnan().any() and not dz.isnan().any()
    assert rel_err(dz, z.grad) < BWD_TOL and rel_err(dx, want_dx) < BWD_TOL


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dk,f,per_head", [(64, 64, True), (128, 32, False)])
@pytest.mark.parametrize("N", (1, 65, 1000))
def test_hedgehog_backward_through_the_op(ops, N, dk, f, per_head, normalize):
    """tk::linear_attention's Hedgehog gradients (the identity backward kernel on the recomputed features, the maps'
    own gradient in PyTorch) for q, k, v and both weights."""
    q, k, v = (t.requires_grad_() for t in inputs(2, 3, N, 64, seed=N + dk, dk=dk))
    wq, wk = (w.requires_grad_() for w in hedgehog_weights(3, dk, f, per_head, seed=N + 1))
    scale = (2 * f) ** -0.5
    out = torch.ops.tk.linear_attention(q, k, v, "hedgehog", wq, wk, scale, normalize, 1e-6)
    do = torch.randn(v.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)).bfloat16()
    out.backward(do)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, wq, wk)]
    la.linear_attention_reference(*leaves[:3], "hedgehog", *leaves[3:], scale, normalize, 1e-6).backward(do.float())
    for name, got, want in zip(("dq", "dk", "dv", "dWq", "dWk"), (q.grad, k.grad, v.grad, wq.grad, wk.grad),
                               (t.grad for t in leaves)):
        assert got.dtype == want.dtype if name.startswith("dW") else got.dtype == torch.bfloat16
        if normalize and N == 1 and name != "dv":
            assert got.float().abs().max().item() < 0.1, f"{name}: one token, want 0"  # o = v, as in check_backward
            continue
        err = rel_err(got, want)
        assert err < 3e-2, f"{name}: relative error {err:.3g} (N{N} dk{dk} f{f} normalize={normalize})"


def test_empty_sequence(ops):
    q, k, v = inputs(1, 2, 0, 64)
    assert ops.linear_attention(q, k, v, "based", None, None, 0.25, True, 1e-6).shape == (1, 2, 0, 64)


# ---------------------------------------------------------------------------- backward (tk_cuda::linear_attention_backward)

BWD_TOL = 2e-2  # relative (norm-wise) error of each gradient vs the fp32 reference's autograd


def check_backward(ops, q, k, v, scale, normalize, eps=1e-6, seed=0, fm="based"):
    o = ops.linear_attention(q, k, v, fm, None, None, scale, normalize, eps)
    do = torch.randn(v.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(v.dtype)
    poison(v.shape)
    dq, dk, dv, dqw, dkw = ops.linear_attention_backward(do, q, k, v, o, fm, None, None, scale, normalize, eps)
    torch.cuda.synchronize()
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16 and dqw.numel() == 0 and dkw.numel() == 0
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    la.linear_attention_reference(*leaves, fm, None, None, scale, normalize, eps).backward(do.float())
    for name, got, want in (("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad), ("dv", dv, leaves[2].grad)):
        assert not got.isnan().any(), f"{name}: unwritten or non-finite"
        if normalize and q.shape[2] == 1 and name != "dv":
            # one token: o = v whatever q and k are, so dq = dk = 0 exactly; the kernel's dq, dk are then
            # (do·v − do·o)·φ'·k / den, where o is the forward's bf16 output: only o's rounding (do, v, k ~ 1)
            assert got.float().abs().max().item() < 0.1, f"{name}: {got.float().abs().max().item():.3g}, want 0"
            continue
        err = rel_err(got, want)
        assert err < BWD_TOL, \
            f"{name}: relative error {err:.3g} ({fm} N{q.shape[2]} dk{q.shape[3]} dv{v.shape[3]} normalize={normalize})"


@pytest.mark.parametrize("grid", ["wide", "small"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dv", [64, 128])
@pytest.mark.parametrize("N", (1, 17, 64, 65, 200, 1000))
def test_based_backward(ops, N, dv, normalize, grid):
    q, k, v = inputs(2, heads(grid, 2, dv), N, dv, seed=N + dv + 1)
    check_backward(ops, q, k, v, 1 / math.sqrt(16), normalize, seed=N)


@pytest.mark.parametrize("grid", ["wide", "small"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 64), (64, 128), (128, 128)])
@pytest.mark.parametrize("N", (1, 17, 64, 65, 200, 1000))
@pytest.mark.parametrize("fm", ["elu1", "identity"])
def test_plain_backward(ops, fm, N, dk, dv, normalize, grid):
    q, k, v = plain_inputs(fm, 2, heads(grid, 2, dv), N, dv, dk, normalize, seed=N + dk + dv + 1)
    check_backward(ops, q, k, v, dk ** -0.5, normalize, seed=N, fm=fm)


def test_plain_backward_strided_and_long(ops):
    q, k, v = inputs(2, 4, 300, 64, layout="bnhd", seed=21, dk=128)
    check_backward(ops, q, k, v, 0.3, True, fm="elu1")
    check_backward(ops, q, k, v, 0.05, False, fm="identity")
    q, k, v = inputs(1, 4, 4096, 64, seed=22, dk=64)
    check_backward(ops, q, k, v, 0.125, True, fm="elu1")


@pytest.mark.parametrize("fm,dk", [("elu1", 64), ("identity", 128)])
def test_plain_backward_through_the_op(ops, fm, dk):
    q, k, v = (t.requires_grad_() for t in inputs(1, 2, 150, 64, seed=24, dk=dk))
    out = torch.ops.tk.linear_attention(q, k, v, fm, None, None, 0.25, fm == "elu1", 1e-6)
    out.float().square().sum().backward()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    la.linear_attention_reference(*leaves, fm, None, None, 0.25, fm == "elu1", 1e-6).float().square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        assert rel_err(got, want) < 3e-2


def test_based_backward_strided_and_many_heads(ops):
    q, k, v = inputs(2, 16, 300, 64, layout="bnhd", seed=12)
    check_backward(ops, q, k, v, 0.25, True)
    q, k, v = inputs(4, 16, 1024, 64, seed=13)
    check_backward(ops, q, k, v, 0.25, True)


def test_based_backward_through_the_op(ops, monkeypatch):
    """tk::linear_attention's autograd runs the backward kernel once BACKWARD_KERNEL_VALIDATED is set."""
    monkeypatch.setattr(la, "BACKWARD_KERNEL_VALIDATED", True)
    q, k, v = (t.requires_grad_() for t in inputs(1, 2, 150, 64, seed=14))
    out = torch.ops.tk.linear_attention(q, k, v, "based", None, None, 0.25, True, 1e-6)
    out.float().square().sum().backward()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    la.linear_attention_reference(*leaves, "based", None, None, 0.25, True, 1e-6).float().square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        assert rel_err(got, want) < 3e-2


@pytest.mark.parametrize("mixer", [dict(feature_map="elu1", form="cumsum", feature_dim=64, scale=0.125),
                                   dict(feature_map="elu1", form="quadratic", feature_dim=128, head_dim=128, scale=1.0),
                                   dict(feature_map="identity", form="quadratic", feature_dim=64, normalize=False,
                                        scale=0.125),
                                   dict(feature_map="hedgehog", form="quadratic", feature_dim=64, scale=0.125),
                                   dict(feature_map="hedgehog_shared", form="cumsum", feature_dim=64, scale=0.125)],
                         ids=["elu1-cumsum-64", "elu1-quadratic-128", "identity-raw-64", "hedgehog-quadratic-64",
                              "hedgehog-shared-cumsum-64"])
def test_plain_model_trains_on_the_kernels(ops, mixer):
    """A small bf16 model of plain linear-attention layers compiled with the backend on CUDA: every layer's mixer is
    replaced by the kernels (forward and backward), and the output and gradients follow an fp32 copy's in eager."""
    import copy
    import sys
    from pathlib import Path

    import tk_inductor

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models_linear import TinyLM

    torch.manual_seed(0)
    mixer = {"head_dim": 64, "heads": 2, **mixer}
    model = TinyLM(layers=2, d_model=128, **mixer).cuda().bfloat16()
    exact = copy.deepcopy(model).float()
    ids = torch.randint(0, 64, (2, 300), device="cuda")
    torch._dynamo.reset()
    tk_inductor.reset()
    out = torch.compile(model, backend="thunderkittens")(ids)
    assert tk_inductor.report().replaced.get("linear_attention") == 2, tk_inductor.report()
    out.float().square().mean().backward()
    want = exact(ids)
    assert rel_err(out, want) < 3e-2
    want.square().mean().backward()
    for p, e in zip(model.parameters(), exact.parameters()):
        assert rel_err(p.grad, e.grad) < 5e-2
