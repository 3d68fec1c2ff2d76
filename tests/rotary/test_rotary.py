"""CPU tests of the rotary family: tk::rotary vs eager, its transposed map, opcheck, errors, and the matcher
(HF Llama rotate_half, GPT-NeoX partial, GPT-J interleaved, written-out variants, must-not-replace)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tk_inductor
import tk_inductor.ops.rotary  # registers tk::rotary

OPTS = {"reference": True, "inner": "aot_eager"}


def compiled(m):
    return torch.compile(m, backend="thunderkittens", options=OPTS)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def eager(x, cos, sin, interleaved):
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    rot = rotate_every_two if interleaved else rotate_half
    y = xr * cos + rot(xr) * sin
    return torch.cat([y, xp], dim=-1) if rd < x.shape[-1] else y


def tables(B, N, rd, interleaved, dtype=torch.float32, general=False):
    """cos/sin per position (B, N, rd); HF-like equal halves/pairs unless `general`."""
    if general:
        return torch.randn(B, N, rd, dtype=dtype), torch.randn(B, N, rd, dtype=dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    ang = torch.arange(N).float()[:, None] * inv[None]
    emb = ang.repeat_interleave(2, -1) if interleaved else torch.cat((ang, ang), -1)
    emb = emb.expand(B, N, rd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [16, 8])
@pytest.mark.parametrize("layout", ["BHND", "BNHD"])
@pytest.mark.parametrize("general", [False, True])
def test_op_matches_eager(interleaved, rd, layout, general):
    torch.manual_seed(0)
    B, H, N, D = 2, 3, 5, 16
    if layout == "BNHD":  # (B, N, H, D) storage seen as (B, H, N, D)
        q = torch.randn(B, N, H, D).transpose(1, 2).requires_grad_()
    else:
        q = torch.randn(B, H, N, D, requires_grad=True)
    k = torch.randn(B, 1, N, D, requires_grad=True)  # GQA-like: other head count
    cos, sin = tables(B, N, rd, interleaved, general=general)
    cos, sin = cos.unsqueeze(1).requires_grad_(), sin.unsqueeze(1).requires_grad_()
    qo, ko = torch.ops.tk.rotary(q, k, cos, sin, interleaved, False, False)
    qe, ke = eager(q, cos, sin, interleaved), eager(k, cos, sin, interleaved)
    torch.testing.assert_close(qo, qe, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ko, ke, atol=1e-6, rtol=1e-6)
    assert qo.stride() == torch.empty_like(q).stride()
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    inputs = (q, k, cos, sin)
    ga = torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), inputs)
    gb = torch.autograd.grad((qe * gq).sum() + (ke * gk).sum(), inputs)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_flag_is_the_transpose(interleaved):
    torch.manual_seed(0)
    x, g = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 16)
    cos, sin = tables(2, 7, 12, interleaved, general=True)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    fx = torch.ops.tk.rotary(x, None, cos, sin, interleaved, False, False)[0]
    bg = torch.ops.tk.rotary(g, None, cos, sin, interleaved, True, False)[0]
    torch.testing.assert_close((fx * g).sum(), (x * bg).sum())
    # and twice backward of forward is not the identity for general tables, but for true rotations it is
    c, s = tables(2, 7, 12, interleaved)
    c, s = c.unsqueeze(1), s.unsqueeze(1)
    y = torch.ops.tk.rotary(x, None, c, s, interleaved, False, False)[0]
    torch.testing.assert_close(torch.ops.tk.rotary(y, None, c, s, interleaved, True, False)[0], x, atol=1e-5, rtol=1e-5)


def test_contiguous_output_flag():
    q = torch.randn(2, 5, 3, 16).transpose(1, 2)
    cos, sin = tables(2, 5, 16, False)
    out = torch.ops.tk.rotary(q, None, cos.unsqueeze(1), sin.unsqueeze(1), False, False, True)[0]
    assert out.is_contiguous()
    torch.testing.assert_close(out, eager(q, cos.unsqueeze(1), sin.unsqueeze(1), False))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_op_low_precision(dtype):
    q = torch.randn(2, 4, 6, 32, dtype=dtype)
    cos, sin = tables(2, 6, 32, False, dtype)
    out = torch.ops.tk.rotary(q, None, cos.unsqueeze(1), sin.unsqueeze(1), False, False, False)[0]
    ref = eager(q.float(), cos.float().unsqueeze(1), sin.float().unsqueeze(1), False)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_opcheck(interleaved):
    q = torch.randn(2, 3, 5, 16, requires_grad=True)
    k = torch.randn(2, 5, 2, 16).transpose(1, 2).requires_grad_()
    cos, sin = tables(2, 5, 8, interleaved)
    torch.library.opcheck(torch.ops.tk.rotary.default, (q, k, cos.unsqueeze(1), sin.unsqueeze(1), interleaved, False, False))
    torch.library.opcheck(torch.ops.tk.rotary.default, (q, None, cos.unsqueeze(1), sin.unsqueeze(1), interleaved, True, True))


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: torch.ops.tk.rotary(torch.randn(2, 4, 8), None, torch.randn(4, 6), torch.randn(4, 7), False, False, False), ValueError),
        (lambda: torch.ops.tk.rotary(torch.randn(2, 4, 8), None, torch.randn(4, 10), torch.randn(4, 10), False, False, False), ValueError),
        (lambda: torch.ops.tk.rotary(torch.randn(2, 4, 8), None, torch.randn(4, 5), torch.randn(4, 5), False, False, False), ValueError),
        (lambda: torch.ops.tk.rotary(torch.randn(2, 4, 8), None, torch.randn(3, 8), torch.randn(3, 8), False, False, False), ValueError),
        (lambda: torch.ops.tk.rotary(torch.randn(2, 4, 8), None, torch.randn(4, 8).double(), torch.randn(4, 8).double(), False, False, False), TypeError),
        (lambda: torch.ops.tk.rotary(torch.ones(2, 4, 8, dtype=torch.int64), None, torch.ones(4, 8), torch.ones(4, 8), False, False, False), TypeError),
        (lambda: torch.ops.tk.rotary(torch.randn(1, 2, 2, 4, 8), None, torch.randn(4, 8), torch.randn(4, 8), False, False, False), ValueError),
        (lambda: torch.ops.tk.rotary(torch.randn(2, 4, 8), torch.randn(2, 4, 6), torch.randn(4, 6), torch.randn(4, 6), False, False, False), ValueError),
    ],
)
def test_bad_inputs(call, error):
    with pytest.raises(error):
        call()


# ---------------------------------------------------------------------------- the matcher

class LlamaRope(nn.Module):
    """HF apply_rotary_pos_emb on q (B, H, N, D) from a (B, N, H, D) projection, and k."""

    def __init__(self, partial=False, unsqueeze_dim=1):
        super().__init__()
        self.partial, self.dim = partial, unsqueeze_dim

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(self.dim), sin.unsqueeze(self.dim)
        if self.partial:  # GPT-NeoX / Phi
            rd = cos.shape[-1]
            q_rot, q_pass = q[..., :rd], q[..., rd:]
            k_rot, k_pass = k[..., :rd], k[..., rd:]
            q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
            k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
            return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class GPTJRope(nn.Module):
    """GPT-J: (B, N, H, D), interleaved pairs, repeat_interleave'd tables, partial rotary_dim."""

    def __init__(self, rotary_dim):
        super().__init__()
        self.rotary_dim = rotary_dim

    @staticmethod
    def apply(t, sin, cos):
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        return (t * cos) + (rotate_every_two(t) * sin)

    def forward(self, q, k, sin, cos):
        r = self.rotary_dim
        k_rot, k_pass = k[:, :, :, :r], k[:, :, :, r:]
        q_rot, q_pass = q[:, :, :, :r], q[:, :, :, r:]
        k_rot = self.apply(k_rot, sin, cos)
        q_rot = self.apply(q_rot, sin, cos)
        return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)


class ChunkNegRope(nn.Module):
    """Other spellings: torch.chunk halves, torch.neg, torch.mul/torch.add, operands swapped."""

    def forward(self, q, cos, sin):
        x1, x2 = torch.chunk(q, 2, dim=-1)
        rot = torch.cat([torch.neg(x2), x1], dim=-1)
        return torch.add(torch.mul(sin, rot), torch.mul(cos, q))


def _check(m, inputs, grad_inputs, count, launches=None):
    tk_inductor.reset()
    out, ref = compiled(m)(*inputs), m(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    ws = [torch.linspace(-1, 1, o.numel()).reshape(o.shape) for o in ref]
    ga = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, ws)), grad_inputs)
    gb = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref, ws)), grad_inputs)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    rep = tk_inductor.report()
    assert rep.replaced.get("rotary", 0) == count, str(rep)


@pytest.mark.parametrize("partial", [False, True])
def test_matches_llama_and_neox(partial):
    torch.manual_seed(0)
    B, H, N, D = 2, 4, 6, 16
    q = torch.randn(B, N, H, D).transpose(1, 2).requires_grad_()
    k = torch.randn(B, 2, N, D, requires_grad=True)
    cos, sin = tables(B, N, 8 if partial else D, False)
    _check(LlamaRope(partial), (q, k, cos, sin), (q, k), 1)  # q and k in one launch


def test_matches_bnhd_layout_unsqueeze_2():
    torch.manual_seed(0)
    q = torch.randn(2, 6, 4, 16, requires_grad=True)  # (B, N, H, D), HF unsqueeze_dim=2
    k = torch.randn(2, 6, 4, 16, requires_grad=True)
    cos, sin = tables(2, 6, 16, False)
    _check(LlamaRope(unsqueeze_dim=2), (q, k, cos, sin), (q, k), 1)


def test_matches_gptj_interleaved_partial():
    torch.manual_seed(0)
    B, N, H, D, r = 2, 6, 4, 16, 8
    q = torch.randn(B, N, H, D, requires_grad=True)
    k = torch.randn(B, N, H, D, requires_grad=True)
    cos, sin = tables(B, N, r, True)
    half = slice(0, r, 2)
    _check(GPTJRope(r), (q, k, sin[..., half].contiguous(), cos[..., half].contiguous()), (q, k), 1)


def test_matches_other_spellings():
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 16, requires_grad=True)
    cos, sin = tables(2, 5, 16, False)
    _check(ChunkNegRope(), (q, cos.unsqueeze(1), sin.unsqueeze(1)), (q,), 1)


def _hf_model(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=128, vocab_size=100, max_position_embeddings=32)
        return transformers.LlamaModel(cfg)
    if name == "neox":
        cfg = transformers.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                         vocab_size=100, max_position_embeddings=32, rotary_pct=0.25)
        return transformers.GPTNeoXModel(cfg)
    if name == "gptj":
        cfg = transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=100, n_positions=32)
        return transformers.GPTJModel(cfg)


@pytest.mark.parametrize("name", ["llama", "neox", "gptj"])
def test_hf_models(name):
    model = _hf_model(name).eval()
    ids = torch.randint(0, 100, (2, 10))
    tk_inductor.reset()
    out = compiled(model)(input_ids=ids).last_hidden_state
    ref = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    rep = tk_inductor.report()
    # one launch per layer (q and k together) where q/k share tables
    assert rep.replaced.get("rotary", 0) >= 2, str(rep)
    params = [p for p in model.parameters() if p.requires_grad]
    w = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    for a, b in zip(torch.autograd.grad((out * w).sum(), params, allow_unused=True),
                    torch.autograd.grad((ref * w).sum(), params, allow_unused=True)):
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------- must not replace

def test_kept_learned_tables():
    q = torch.randn(2, 3, 5, 16)
    cos, sin = tables(2, 5, 16, False)
    cos, sin = cos.unsqueeze(1).requires_grad_(), sin.unsqueeze(1).requires_grad_()
    tk_inductor.reset()
    m = ChunkNegRope()
    torch.testing.assert_close(compiled(m)(q, cos, sin), m(q, cos, sin))
    rep = tk_inductor.report()
    assert not rep.replaced.get("rotary") and any("require grad" in r for f, r in rep.kept if f == "rotary"), str(rep)


def test_promoting_tables_replaced_with_eagers_dtype():
    """fp32 tables on bf16 activations (HF's tables under autocast): the result is fp32, as in eager."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = tables(2, 5, 16, False)
    tk_inductor.reset()
    m = ChunkNegRope()
    out = compiled(m)(q, cos.unsqueeze(1), sin.unsqueeze(1))
    ref = m(q, cos.unsqueeze(1), sin.unsqueeze(1))
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    (ga,), (gb,) = torch.autograd.grad(out, q, g), torch.autograd.grad(ref, q, g)
    assert ga.dtype == torch.bfloat16
    torch.testing.assert_close(ga, gb, rtol=1e-2, atol=1e-2)
    assert tk_inductor.report().replaced.get("rotary") == 1, str(tk_inductor.report())


class CastBack(nn.Module):
    """The promoted result cast back (autocast's cast in front of attention, written out)."""

    def forward(self, q, k, cos, sin):
        return (rotate_half(q) * sin + q * cos).to(q.dtype), (k * cos + rotate_half(k) * sin).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_after_promotion_is_fused(dtype):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 1, 5, 16, dtype=dtype, requires_grad=True)
    cos, sin = (t.unsqueeze(1) for t in tables(2, 5, 16, False))
    tk_inductor.reset()
    m = CastBack()
    out = compiled(m)(q, k, cos, sin)
    ref = m(q, k, cos, sin)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b)  # one rounding of the same fp32 value
    assert tk_inductor.report().replaced.get("rotary") == 1, str(tk_inductor.report())
    g = [torch.randn_like(t) for t in ref]
    ga = torch.autograd.grad(out, (q, k), g)
    gb = torch.autograd.grad(ref, (q, k), g)
    for a, b in zip(ga, gb):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32])
def test_op_output_dtype(out_dtype):
    q = torch.randn(2, 3, 5, 16, dtype=torch.bfloat16)
    cos, sin = (t.unsqueeze(1) for t in tables(2, 5, 16, False))
    qo, ko = torch.ops.tk.rotary(q, None, cos, sin, False, False, False, out_dtype)
    want = out_dtype or torch.float32
    assert qo.dtype == ko.dtype == want
    torch.testing.assert_close(qo, eager(q.float(), cos, sin, False).to(want))
    with pytest.raises(TypeError, match="out_dtype"):
        torch.ops.tk.rotary(q, None, cos, sin, False, False, False, torch.int32)
    with pytest.raises(TypeError, match="sin dtype"):
        torch.ops.tk.rotary(q, None, cos, sin.double().float().bfloat16(), False, False, False)


class WrongSign(nn.Module):
    def forward(self, q, cos, sin):
        h = q.shape[-1] // 2
        return q * cos + torch.cat((q[..., h:], -q[..., :h]), -1) * sin  # rotation by -90°: not the op


class OtherTensor(nn.Module):
    def forward(self, q, k, cos, sin):
        return q * cos + rotate_half(k) * sin


def test_not_matched_lookalikes():
    q, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    cos, sin = tables(2, 5, 16, False)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for m, args in ((WrongSign(), (q, cos, sin)), (OtherTensor(), (q, k, cos, sin))):
        tk_inductor.reset()
        torch._dynamo.reset()
        torch.testing.assert_close(compiled(m)(*args), m(*args))
        rep = tk_inductor.report()
        assert not rep.replaced.get("rotary") and not any(f == "rotary" for f, _ in rep.kept), str(rep)


class HalfTablesRope(nn.Module):
    """gpt-oss's `_apply_rotary_emb`: the halves of q and k by chunk (or slices), half-width tables (each pair's
    angle once), cat((x1·c − x2·s, x2·c + x1·s))."""

    def __init__(self, slices=False, swapped=False):
        super().__init__()
        self.slices, self.swapped = slices, swapped

    def rope(self, x, c, s):
        if self.slices:
            h = x.shape[-1] // 2
            x1, x2 = x[..., :h], x[..., h:]
        else:
            x1, x2 = torch.chunk(x, 2, dim=-1)
        if self.swapped:  # operands and terms in the other order
            return torch.cat((c * x1 - s * x2, s * x1 + c * x2), dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def forward(self, q, k, cos, sin):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return self.rope(q, c, s), self.rope(k, c, s)


@pytest.mark.parametrize("slices, swapped", [(False, False), (True, True)])
def test_matches_half_width_tables(slices, swapped):
    """gpt-oss's spelling is NeoX's rotation with the tables doubled (rotary_half_tables): q and k in one launch."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 16, requires_grad=True)
    k = torch.randn(2, 2, 6, 16, requires_grad=True)
    cos, sin = tables(2, 6, 16, False)
    _check(HalfTablesRope(slices, swapped), (q, k, cos[..., :8].contiguous(), sin[..., :8].contiguous()), (q, k), 1)


class HalfTablesWrongSign(nn.Module):
    def forward(self, q, cos, sin):
        x1, x2 = torch.chunk(q, 2, dim=-1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat((x1 * c + x2 * s, x2 * c - x1 * s), dim=-1)  # rotation by the negative angle


def test_half_width_tables_lookalike_not_matched():
    q = torch.randn(2, 3, 5, 16)
    cos, sin = tables(2, 5, 8, False)
    tk_inductor.reset()
    torch._dynamo.reset()
    m = HalfTablesWrongSign()
    torch.testing.assert_close(compiled(m)(q, cos, sin), m(q, cos, sin))
    assert not tk_inductor.report().replaced.get("rotary"), str(tk_inductor.report())


class ComplexRope(nn.Module):
    """torchtitan's / Meta's llama `apply_rotary_emb`: consecutive pairs as complex numbers times freqs_cis (one
    complex factor per pair and position), back to real, cast to x's dtype."""

    def forward(self, xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        f = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        xq_out = torch.view_as_real(xq_ * f).flatten(3)
        xk_out = torch.view_as_real(xk_ * f).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)


def _freqs_cis(N, D, theta=10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    return torch.polar(torch.ones(N, D // 2), torch.outer(torch.arange(N).float(), freqs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_complex_spelling(dtype):
    """(B, N, H, D) q and k as torchtitan lays them out: GPT-J's interleaved rotation with the real and imaginary parts
    repeated per pair (rotary_complex_tables), q and k in one launch, the cast back fused."""
    torch.manual_seed(0)
    q = torch.randn(2, 6, 4, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 6, 2, 16, dtype=dtype, requires_grad=True)
    freqs = _freqs_cis(6, 16)
    m = ComplexRope()
    tk_inductor.reset()
    torch._dynamo.reset()
    out, ref = compiled(m)(q, k, freqs), m(q, k, freqs)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    w = [torch.linspace(-1, 1, o.numel()).reshape(o.shape).to(dtype) for o in ref]
    ga = torch.autograd.grad(sum((o * x).sum() for o, x in zip(out, w)), (q, k))
    gb = torch.autograd.grad(sum((o * x).sum() for o, x in zip(ref, w)), (q, k))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, **tol)
    assert tk_inductor.report().replaced.get("rotary") == 1, str(tk_inductor.report())


def test_complex_spelling_with_learned_factors_is_kept():
    q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
    freqs = _freqs_cis(6, 16).requires_grad_()
    tk_inductor.reset()
    torch._dynamo.reset()
    m = ComplexRope()
    out = compiled(m)(q, k, freqs)
    torch.testing.assert_close(out, m(q, k, freqs))
    assert not tk_inductor.report().replaced.get("rotary")
    assert any("learned" in why for f, why in tk_inductor.report().kept if f == "rotary"), str(tk_inductor.report())
