"""tk::ssd: the chunked reference against the sequential recurrence, opcheck, gradients, validation,
and the rewrite of Mamba-2 SSD spellings (HF Mamba2 torch path in its einsum and in its
broadcast-multiply-sum form, mamba_ssm's ssd_minimal_discrete form) in reference mode on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from dynamo_tracing import einops_stays_one_op
from tolerance import summed
from tk_inductor import config, rewrite
from tk_inductor.ops import ssd as ops

try:  # the einops spellings (rearrange, repeat) run where einops is installed (the test extra)
    import einops
except ImportError:
    einops = None

OPTIONS = {"reference": True, "inner": "aot_eager"}


def _inputs(b=2, l=37, nh=4, p=8, ng=2, n=6, dtype=torch.float64, seed=0, D=True, h0=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, nh, p, generator=g, dtype=dtype)
    dt = F.softplus(torch.randn(b, l, nh, generator=g, dtype=dtype) - 1)
    A = -torch.rand(nh, generator=g, dtype=dtype) * 2 - 0.1
    B = torch.randn(b, l, ng, n, generator=g, dtype=dtype)
    C = torch.randn(b, l, ng, n, generator=g, dtype=dtype)
    Dv = torch.randn(nh, generator=g, dtype=dtype) if D else None
    init = torch.randn(b, nh, p, n, generator=g, dtype=dtype) if h0 else None
    return x, dt, A, B, C, Dv, init


# ---------------------------------------------------------------------------- op semantics

@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
@pytest.mark.parametrize("D, h0", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("l", [1, 37, 64])
def test_chunked_reference_equals_sequential_recurrence(chunk, D, h0, l):
    args = _inputs(l=l, D=D, h0=h0)
    y, state = ops.ssd_reference(*args, chunk)
    y_seq, state_seq = ops.ssd_recurrence(*args)
    torch.testing.assert_close(y, y_seq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, state_seq, rtol=1e-10, atol=1e-10)


def test_heads_share_groups_like_mamba():
    """Head h reads group h // (nh / ng): same as repeating each group over its heads."""
    x, dt, A, B, C, D, h0 = _inputs(nh=6, ng=3)
    y, s = torch.ops.tk.ssd(x, dt, A, B, C, D, h0, 16)
    y2, s2 = ops.ssd_recurrence(x, dt, A, B.repeat_interleave(2, dim=2), C.repeat_interleave(2, dim=2), D, h0)
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(s, s2)


def test_output_dtypes_and_layout():
    x, dt, A, B, C, D, h0 = (t.to(torch.bfloat16) for t in _inputs(dtype=torch.float32))
    y, s = torch.ops.tk.ssd(x, dt, A.float(), B, C, D, h0, 64)
    assert y.dtype == torch.bfloat16 and y.is_contiguous() and y.shape == x.shape
    assert s.dtype == torch.float32 and s.is_contiguous() and s.shape == h0.shape
    y64, s64 = ops.ssd_recurrence(*(t.double() for t in (x, dt, A, B, C, D, h0)))
    torch.testing.assert_close(y.double(), y64, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s.double(), s64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("D, h0", [(True, True), (False, False)])
def test_opcheck(D, h0):
    args = [None if t is None else t.float().requires_grad_() for t in _inputs(l=19, D=D, h0=h0)]
    torch.library.opcheck(torch.ops.tk.ssd.default, (*args, 8))


def test_gradcheck():
    args = [t.requires_grad_() for t in _inputs(b=1, l=11, nh=2, p=3, ng=1, n=2)]
    assert torch.autograd.gradcheck(lambda *a: torch.ops.tk.ssd(*a, 4), args)


def test_gradient_of_final_state_only():
    args = [t.requires_grad_() for t in _inputs(b=1, l=9, nh=2, p=3, ng=1, n=2)]
    _, state = torch.ops.tk.ssd(*args, 4)
    got = torch.autograd.grad(state.sum(), args)
    _, state_ref = ops.ssd_recurrence(*args)
    want = torch.autograd.grad(state_ref.sum(), args, allow_unused=True)  # C and D do not reach the state
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w)


@pytest.mark.parametrize("change, error", [
    (dict(x=torch.randn(2, 8, 4)), ValueError),
    (dict(dt=torch.rand(2, 8, 3)), ValueError),
    (dict(A=torch.rand(3)), ValueError),
    (dict(B=torch.randn(2, 8, 3, 6), C=torch.randn(2, 8, 3, 6)), ValueError),
    (dict(C=torch.randn(2, 8, 2, 5)), ValueError),
    (dict(D=torch.randn(5)), ValueError),
    (dict(initial_state=torch.randn(2, 4, 8, 5)), ValueError),
    (dict(chunk_size=0), ValueError),
    (dict(dt=torch.ones(2, 8, 4, dtype=torch.int32)), TypeError),
])
def test_bad_inputs_raise_clear_errors(change, error):
    args = dict(x=torch.randn(2, 8, 4, 3), dt=torch.rand(2, 8, 4), A=-torch.rand(4), B=torch.randn(2, 8, 2, 6),
                C=torch.randn(2, 8, 2, 6), D=None, initial_state=None, chunk_size=4)
    args.update(change)
    with pytest.raises(error, match="tk::ssd"):
        torch.ops.tk.ssd(*args.values())


# ---------------------------------------------------------------------------- spellings

def _segsum(x, first_diagonal=-1, einops_like=False, naive=None):
    T = x.size(-1)
    if naive:  # the Mamba-2 blog's first listing: a difference of cumsums ("reversed", "strict": wrong on purpose)
        x_cumsum = torch.cumsum(x, dim=-1)
        rows, cols = x_cumsum[..., :, None], x_cumsum[..., None, :]
        segsum = cols - rows if naive == "reversed" else rows - cols
        keep = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=-1 if naive == "strict" else 0)
        return segsum.masked_fill(~keep, -torch.inf)
    # einops' repeat("... d -> ... d e") adds the axis with a reshape
    x = (x.reshape(*x.shape, 1) if einops_like else x[..., None]).expand(*x.size(), T)
    x = x.masked_fill(~torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=first_diagonal), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=0), -torch.inf)


def _chunks(t, pad, chunk):
    t = F.pad(t, (0, 0, 0, 0, 0, pad, 0, 0) if t.dim() == 4 else (0, 0, 0, pad, 0, 0))
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])


def ssd_mul_sum(x, dt, A, B, C, chunk, D=None, h0=None, *, segsum_diagonal=-1, other_dt=None, a_transposed=False):
    """The HF transformers 5.17 / 4.x torch-path spelling: contractions as broadcast products + sums. a_transposed: A·dt
    made (b, h, l) first, then padded and chunked along its last dim."""
    b, l, h, p = x.shape
    x = x.float()
    B = B.float().repeat_interleave(h // B.shape[2], dim=2, output_size=h)
    C = C.float().repeat_interleave(h // C.shape[2], dim=2, output_size=h)
    pad = (chunk - l % chunk) % chunk
    D_res = D[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad, 0, 0)) if D is not None else None
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * (dt if other_dt is None else other_dt).float()
    if a_transposed:
        A = F.pad(A.transpose(1, 2), (0, pad)).reshape(b, h, -1, chunk)
        x, B, C = (_chunks(t, pad, chunk) for t in (x, B, C))
    else:
        x, A, B, C = (_chunks(t, pad, chunk) for t in (x, A, B, C))
        A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segsum(A, segsum_diagonal))
    G = (C[:, :, :, None, :, :] * B[:, :, None, :, :, :]).sum(dim=-1)
    M = (G[..., None] * L.permute(0, 2, 3, 4, 1)[..., None]).sum(dim=-1)
    Y_diag = (M[..., None] * x[:, :, None]).sum(dim=3)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = (B_decay[..., None, :] * x[..., None]).sum(dim=2)
    previous = h0[:, None].to(dtype=states.dtype) if h0 is not None else torch.zeros_like(states[:, :1])
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(_segsum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = (decay_chunk[..., None, None] * states[:, :, None, ...]).sum(dim=1)
    states, final = new_states[:, :-1], new_states[:, -1]
    C_times_states = C[..., None, :] * states[:, :, None, ...]
    Y_off = C_times_states.sum(-1) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (Y_diag + Y_off).reshape(b, -1, h, p)
    if D_res is not None:
        y = y + D_res
    if pad > 0:
        y = y[:, :l]
    return y, final


def ssd_minimal(X, A, B, C, block_len, initial_states=None, spelling=()):
    """mamba_ssm's ssd_minimal_discrete, the Mamba-2 paper's listing (4-operand einsums), with einops' rearrange as
    reshape/permute (or einops itself), in the spellings people write it: chunks by reshape with explicit sizes, -1
    or view; chunk ends indexed [:, :, :, -1:] or [..., -1:], kept as unsqueeze(-1) or [..., -1, None]; segsum as the
    masked cumsum or as a difference of cumsums ("naive-segsum"); A's chunks made from its (b, h, l) transpose
    ("a-transposed"); chunk ends as narrow(-1, -1, 1) ("narrow") or indexed by block_len - 1 ("explicit-last")."""
    naive = next((t.removeprefix("naive-segsum").lstrip("-") or "difference" for t in spelling
                  if t.startswith("naive-segsum")), None)
    b, l, h, p = X.shape
    A_flat = A
    if "einops" in spelling:
        X, A, B, C = (einops.rearrange(t, "b (c l) ... -> b c l ...", l=block_len) for t in (X, A, B, C))
        A = einops.rearrange(A, "b c l h -> b h c l")
    else:
        if "minus-one" in spelling:
            X, A, B, C = (t.reshape(b, -1, block_len, *t.shape[2:]) for t in (X, A, B, C))
        elif "view" in spelling:
            X, A, B, C = (t.view(b, l // block_len, block_len, *t.shape[2:]) for t in (X, A, B, C))
        else:
            X, A, B, C = (t.reshape(b, l // block_len, block_len, *t.shape[2:]) for t in (X, A, B, C))
        A = A.permute(0, 3, 1, 2)
    if "a-transposed" in spelling:
        A = A_flat.transpose(1, 2).reshape(b, h, l // block_len, block_len)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segsum(A, einops_like=True, naive=naive))
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, X)
    if "unsqueeze" in spelling:
        end = A_cumsum[..., -1].unsqueeze(-1)
    elif "new-axis" in spelling:
        end = A_cumsum[..., -1, None]
    elif "narrow" in spelling:
        end = A_cumsum.narrow(-1, -1, 1)
    elif "explicit-last" in spelling:
        end = A_cumsum[:, :, :, block_len - 1:]
    else:
        end = A_cumsum[..., -1:] if "ellipsis" in spelling else A_cumsum[:, :, :, -1:]
    decay_states = torch.exp(end - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    if initial_states is None:
        initial_states = torch.zeros_like(states[:, :1])
    states = torch.cat([initial_states, states], dim=1)
    ends = A_cumsum[..., -1] if "ellipsis" in spelling else A_cumsum[:, :, :, -1]
    if "explicit-last" in spelling:
        ends = A_cumsum[:, :, :, block_len - 1]
    decay_chunk = torch.exp(_segsum(F.pad(ends, (1, 0)), einops_like=True, naive=naive))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    return (Y_diag + Y_off).reshape(b, -1 if "minus-one" in spelling else l, h, p), final_state


def _heads(G, h, spelling):
    """Groups to heads: repeat_interleave, an expand and reshape of the same layout, einops' repeat, or tiled
    (head i takes group i % groups, by expand or by Tensor.repeat: another model, matched with the per-head tensor
    itself)."""
    b, l, g, n = G.shape
    if "repeat" in spelling:
        return G.repeat(1, 1, h // g, 1)
    if "expand" in spelling:
        return G[:, :, :, None].expand(b, l, g, h // g, n).reshape(b, l, h, n)
    if "tile" in spelling:
        return G[:, :, None].expand(b, l, h // g, g, n).reshape(b, l, h, n)
    if "einops-repeat" in spelling:
        return einops.repeat(G, "b l g n -> b l (g r) n", r=h // g)
    return G.repeat_interleave(h // g, dim=2)


class MulSumSSD(nn.Module):
    def __init__(self, chunk=8, D=True, h0=False, segsum_diagonal=-1, use_other_dt=False, a_transposed=False):
        super().__init__()
        self.chunk, self.D, self.h0 = chunk, D, h0
        self.segsum_diagonal, self.use_other_dt, self.a_transposed = segsum_diagonal, use_other_dt, a_transposed

    def forward(self, x, dt, A, B, C, D, h0, dt2):
        return ssd_mul_sum(x, dt, A, B, C, self.chunk, D if self.D else None, h0 if self.h0 else None,
                           segsum_diagonal=self.segsum_diagonal, other_dt=dt2 if self.use_other_dt else None,
                           a_transposed=self.a_transposed)


class MinimalSSD(nn.Module):
    def __init__(self, chunk=8, h0=True, spelling=(), dtype=None):
        super().__init__()
        self.chunk, self.h0, self.spelling, self.dtype = chunk, h0, spelling, dtype

    def forward(self, x, dt, A, B, C, D, h0, dt2):
        Bh, Ch = (_heads(G, x.shape[2], self.spelling) for G in (B, C))
        if self.dtype is not None:  # computed in bf16 throughout, as the listing does with bf16 inputs
            x, dt, A, Bh, Ch = (t.to(self.dtype) for t in (x, dt, A, Bh, Ch))
        # "a-broadcast": A written against dt's axes, A[None, None, :] * dt
        a = A[None, None, :] * dt if "a-broadcast" in self.spelling else A * dt
        return ssd_minimal(x * dt[..., None], a, Bh, Ch, self.chunk, h0[:, None] if self.h0 else None, self.spelling)


def _spelling_inputs(l=21, requires_grad=False):
    x, dt, A, B, C, D, h0 = (t.float() for t in _inputs(l=l))
    dt2 = dt.flip(1).contiguous()
    args = [x, dt, A, B, C, D, h0, dt2]
    return [t.requires_grad_(requires_grad) for t in args]


def _compile_and_compare(module, args, *, replaced=1, grads=True):
    torch._dynamo.reset()
    tk_inductor.reset()
    compiled = torch.compile(module, backend="thunderkittens", options=OPTIONS)
    out = compiled(*args)
    assert tk_inductor.report().replaced.get("ssd", 0) == replaced, tk_inductor.report().kept
    want = module(*args)
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5)
    if grads:
        leaves = [a for a in args if a.requires_grad]
        gen = torch.Generator().manual_seed(3)
        seeds = [torch.randn(w.shape, generator=gen, dtype=w.dtype) for w in want]
        got = torch.autograd.grad(out, leaves, seeds, allow_unused=True)
        ref = torch.autograd.grad(want, leaves, seeds, allow_unused=True)
        terms = args[0].numel()  # each gradient sums over the sequence, heads and channels
        for g, r in zip(got, ref):
            if r is None:
                assert g is None or not g.any()
            else:
                torch.testing.assert_close(g, r, **summed(r, terms))
    return tk_inductor.report()


@pytest.mark.parametrize("l", [16, 21])  # 21: padded to 24 and sliced back
@pytest.mark.parametrize("D, h0", [(True, False), (False, True), (True, True)])
def test_mul_sum_spelling_is_replaced_and_equal(l, D, h0):
    _compile_and_compare(MulSumSSD(chunk=8, D=D, h0=h0), _spelling_inputs(l=l, requires_grad=True))


@pytest.mark.parametrize("l", [16, 21])
def test_mul_sum_spelling_with_a_chunked_after_a_transpose(l):
    """A·dt made (b, h, l), padded at the end of l and chunked along it (the matcher's _chunks on dim 2)."""
    _compile_and_compare(MulSumSSD(chunk=8, a_transposed=True), _spelling_inputs(l=l, requires_grad=True))


@pytest.mark.parametrize("h0", [False, True])
def test_ssd_minimal_spelling_is_replaced_and_equal(h0):
    _compile_and_compare(MinimalSSD(chunk=8, h0=h0), _spelling_inputs(l=24, requires_grad=True))


@pytest.mark.parametrize("spelling", [("minus-one",), ("view",), ("ellipsis",), ("unsqueeze",), ("new-axis",),
                                      ("expand",), ("tile",), ("repeat",), ("einops",), ("einops-repeat",),
                                      ("naive-segsum",), ("a-broadcast",), ("a-transposed",), ("narrow",),
                                      ("explicit-last",),
                                      ("minus-one", "ellipsis", "new-axis", "expand"),
                                      ("naive-segsum", "a-broadcast", "view", "unsqueeze")], ids="+".join)
def test_ssd_minimal_spellings_are_replaced_and_equal(spelling):
    if any(s.startswith("einops") for s in spelling):
        if einops is None:
            pytest.skip("einops is not installed")
        if einops_stays_one_op():
            pytest.skip("this torch's Dynamo keeps einops calls as single graph ops (torch 2.11 does); the matcher "
                        "reads the torch ops they trace to")
    _compile_and_compare(MinimalSSD(chunk=8, h0=True, spelling=spelling), _spelling_inputs(l=24, requires_grad=True))


def test_ssd_minimal_dynamic_lengths():
    """dynamic=True: one compile serves two lengths (the repeat_interleave count is symbolic then)."""
    torch._dynamo.reset()
    tk_inductor.reset()
    module = MinimalSSD(chunk=8, h0=True)
    compiled = torch.compile(module, backend="thunderkittens", options=OPTIONS, dynamic=True)
    for l in (24, 40):
        args = _spelling_inputs(l=l)
        for o, w in zip(compiled(*args), module(*args)):
            torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5)
    report = tk_inductor.report()
    assert report.replaced == {"ssd": 1} and len(report.graphs) == 1, report


class MinimalSSDStateInput(nn.Module):
    """The listing given its initial state as a (b, 1, h, p, n) tensor made elsewhere (another graph)."""

    def forward(self, x, dt, A, B, C, D, h0, dt2):
        Bh, Ch = (_heads(G, x.shape[2], ()) for G in (B, C))
        return ssd_minimal(x * dt[..., None], A * dt, Bh, Ch, 8, h0.unsqueeze(1).contiguous() * 1.0)


def test_ssd_minimal_with_an_initial_state_tensor():
    report = _compile_and_compare(MinimalSSDStateInput(), _spelling_inputs(l=24, requires_grad=True))
    assert report.replaced == {"ssd": 1}


def test_ssd_minimal_in_bf16_is_replaced_with_the_eager_dtypes():
    """Computed in bf16 throughout: the op accumulates in fp32 and returns y and the final state in bf16 (the state
    cast from the op's fp32), close to the eager bf16 listing and closer to its fp64 value."""
    module = MinimalSSD(chunk=8, h0=False, dtype=torch.bfloat16)
    args = _spelling_inputs(l=24)
    torch._dynamo.reset()
    tk_inductor.reset()
    out = torch.compile(module, backend="thunderkittens", options=OPTIONS)(*args)
    assert tk_inductor.report().replaced.get("ssd") == 1, tk_inductor.report().kept
    eager = module(*args)
    exact = MinimalSSD(chunk=8, h0=False, dtype=torch.float64)(*args)
    for o, e, x in zip(out, eager, exact):
        assert o.dtype == e.dtype == torch.bfloat16
        err = lambda a: float((a.double() - x).norm() / x.norm())  # noqa: E731
        assert err(o) < 1e-2 and err(o) <= err(e) * 1.5, (err(o), err(e))


def test_rewritten_op_arguments():
    """The op gets the group-level B/C (not the per-head repeat), the chunk size, D and h0."""
    cfg = config.current(OPTIONS)
    calls = []

    def backend(gm, example_inputs):
        rewrite.run(gm, cfg)
        calls.extend(n for n in gm.graph.nodes if n.target is torch.ops.tk.ssd.default)
        return gm

    torch._dynamo.reset()
    args = _spelling_inputs()
    torch.compile(MulSumSSD(chunk=8, D=True, h0=True), backend=backend)(*args)
    (call,) = calls
    x, dt, A, B, C, D, h0, chunk = call.args
    assert [rewrite.example(t).shape for t in (x, dt, A, B, C, D, h0)] == [t.shape for t in args[:7]]
    assert chunk == 8


@pytest.mark.parametrize("variant, why", [
    (dict(segsum_diagonal=0), None),  # a different intra-chunk decay: not SSD
    (dict(use_other_dt=True), "different dt"),  # x and A discretised with different dt
])
def test_not_provably_ssd_is_not_replaced(variant, why):
    module = MulSumSSD(chunk=8, **variant)
    args = _spelling_inputs(l=16)
    torch._dynamo.reset()
    tk_inductor.reset()
    out = torch.compile(module, backend="thunderkittens", options=OPTIONS)(*args)
    report = tk_inductor.report()
    assert "ssd" not in report.replaced
    if why:
        assert any(f == "ssd" and why in r for f, r in report.kept), report.kept
    for o, w in zip(out, MulSumSSD(chunk=8, **variant)(*args)):
        torch.testing.assert_close(o, w)


@pytest.mark.parametrize("flaw", ["reversed", "strict"])
def test_segsum_as_a_difference_must_be_exact(flaw):
    """cs[..., None, :] - cs[..., :, None] (the decay's inverse) or a mask without the diagonal is not the SSD: not
    replaced, and the compiled model still equals eager."""
    module = MinimalSSD(chunk=8, h0=True, spelling=("naive-segsum-" + flaw,))
    args = _spelling_inputs(l=16)
    torch._dynamo.reset()
    tk_inductor.reset()
    out = torch.compile(module, backend="thunderkittens", options=OPTIONS)(*args)
    assert "ssd" not in tk_inductor.report().replaced
    for o, w in zip(out, module(*args)):
        torch.testing.assert_close(o, w, equal_nan=True)


def _training_reasons(module, options=None, l=24):
    cfg = config.current({"inner": "aot_eager"} | (options or {}))
    reports = []

    def backend(gm, example_inputs):
        reports.append(rewrite.run(gm, cfg)[0])
        return gm

    torch._dynamo.reset()
    torch.compile(module, backend=backend)(*_spelling_inputs(l=l, requires_grad=True))
    assert "ssd" not in reports[0].replaced
    return [r for f, r in reports[0].kept if f == "ssd"]


CPU_REASON = "device cpu (kernels are CUDA-only; reference mode runs anywhere)"


@pytest.mark.parametrize("validated", [False, True])
def test_training_keeps_an_einsum_spelling_until_the_backward_kernel(validated, monkeypatch):
    """Without a backward kernel, Inductor's matmuls of an einsum spelling beat the reference's autograd; once the
    kernel is validated, training takes it (and on this CPU the device rule keeps it)."""
    monkeypatch.setattr(ops, "BACKWARD_KERNEL_VALIDATED", validated)
    want = CPU_REASON if validated else "training, and the op has no backward kernel yet"
    assert _training_reasons(MinimalSSD(chunk=8)) == [want]


def test_training_takes_the_multiply_and_sum_spelling():
    """HF Mamba2's multiply-and-sum chains: the reference's autograd is measured faster than what Inductor makes of
    them, so training takes the op too; on this CPU the next rule keeps it (kernels are CUDA-only)."""
    assert _training_reasons(MulSumSSD(chunk=8)) == [CPU_REASON]


def test_reference_backward_option_takes_any_spelling():
    assert _training_reasons(MinimalSSD(chunk=8), {"reference_backward": "ssd"}) == [CPU_REASON]


# ---------------------------------------------------------------------------- HF Mamba2

def _tiny_mamba2(layers=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=layers, state_size=8, expand=2,
                                    head_dim=8, num_heads=8, n_groups=2, chunk_size=8, conv_kernel=4)
    torch.manual_seed(0)
    return transformers.Mamba2Model(cfg)


@pytest.mark.parametrize("length", [16, 13])
def test_hf_mamba2_reference_mode_equals_eager(length):
    model = _tiny_mamba2().eval()
    ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    tk_inductor.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="thunderkittens", options=OPTIONS)(ids).last_hidden_state
        want = model(ids).last_hidden_state
    assert tk_inductor.report().replaced.get("ssd") == 2, tk_inductor.report().kept
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_hf_mamba2_training_gradients_match():
    model = _tiny_mamba2().train()
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    tk_inductor.reset()
    out = torch.compile(model, backend="thunderkittens", options={**OPTIONS, "ops": ["ssd"]})(ids).last_hidden_state
    assert tk_inductor.report().replaced.get("ssd") == 2
    out.square().mean().backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model(ids).last_hidden_state.square().mean().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-3, atol=1e-5, msg=k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_op_matches_recurrence():
    x, dt, A, B, C, D, h0 = (t.cuda() for t in _inputs(b=2, l=300, nh=8, p=64, ng=1, n=64, dtype=torch.float32))
    with torch.no_grad():
        y, s = torch.ops.tk.ssd(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, h0, 64)
    y64, s64 = ops.ssd_recurrence(*(t.double() for t in (x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, h0)))
    assert not y.isnan().any() and not s.isnan().any()
    # The kernel multiplies bf16 operands (scores, states and decay-scaled B, as mamba_ssm's chunk scan does): an
    # element of y sums 64 products each rounded to ~0.4%, so its error reaches a few % of mean |y| (measured on
    # the H200: 0.12 at mean |y| 4.7). Norm-wise error, and elementwise at y's scale.
    for got, want in ((y, y64), (s, s64)):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=4e-2 * want.abs().mean().item())


def test_hf_mamba2_dynamic_lengths():
    """A second length recompiles with a symbolic l (automatic dynamic): padding and chunking are still proven."""
    model = _tiny_mamba2().eval()
    torch._dynamo.reset()
    tk_inductor.reset()
    compiled = torch.compile(model, backend="thunderkittens", options=OPTIONS)
    with torch.no_grad():
        for length in (16, 13, 29):
            ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
            torch.testing.assert_close(compiled(ids).last_hidden_state, model(ids).last_hidden_state, rtol=1e-4, atol=1e-5)
    assert tk_inductor.report().replaced.get("ssd") == 4, tk_inductor.report().kept  # 2 graphs x 2 layers


def test_kernel_supports_names_what_the_ssd_kernel_does_not_compute():
    from tk_inductor.ops import ssd as ssd_ops

    assert ssd_ops.kernel_supports(16, 64) is None and ssd_ops.kernel_supports(32, 64) is None
    assert ssd_ops.kernel_supports(64, 128) is None
    assert ssd_ops.kernel_supports(48, 64) is None and ssd_ops.kernel_supports(256, 32) is None  # in parts
    assert "head dim 48" in ssd_ops.kernel_supports(128, 48)
    assert "head dim 16" in ssd_ops.kernel_supports(128, 16)
