"""GPU tests of the attention kernels (tk_cuda::attention / attention_backward)
against an fp32 PyTorch reference. Skipped without CUDA.

Outputs are poisoned before every kernel call: blocks of the outputs' sizes are
filled with NaN and freed just before the call, so the caching allocator hands
them back to the op and any element the kernel fails to write shows as NaN.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# The kernels each call runs follow from the head dim, the mask and the scale (csrc/kernels/attention/README.md):
# the forward's ping-pong configuration per (D, causal), scales <= 0 folded into q, and the dynamic task schedule
# under a causal mask; the backward's configuration per D, in L2 sections of heads under a causal mask.
LENGTHS = (1, 17, 128, 1000, 4096)
OUT_TOL = 1e-2  # relative (norm-wise) error vs fp32, bf16/fp16 outputs
GRAD_TOL = 2e-2


@pytest.fixture(scope="module")
def ops():
    from tk_inductor import build

    build.load("attention")
    return torch.ops.tk_cuda


def reference(q, k, v, causal, scale, window=0, softcap=0.0, keep=None, segments=None):
    """fp32 attention with GQA by repeating K/V, a top-left causal mask (row i sees keys j <= i), a sliding window
    (also i - j < window; without causal a two-sided one, |i - j| < window), softcapped scores, a key-padding mask
    (B, M) (True: visible) and packed-sequence ids (B, N) (a query sees the keys of its own id); returns (o, lse),
    o = 0 and lse = -inf on rows without a visible key."""
    qf, kf, vf = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    n, m = s.shape[-2:]
    i = torch.arange(n, device=s.device)[:, None]
    j = torch.arange(m, device=s.device)[None, :]
    allowed = torch.ones(n, m, dtype=torch.bool, device=s.device)
    if causal:
        allowed &= j <= i
    if window:
        allowed &= (i - j < window) if causal else ((i - j).abs() < window)
    if keep is not None:
        allowed = allowed & keep.bool()[:, None, None, :]
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    mx = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - torch.where(torch.isfinite(mx), mx, 0.0))  # a safe softmax: exactly 0 on rows without keys
    total = e.sum(-1, keepdim=True)
    return (e / torch.where(total > 0, total, 1.0)) @ vf, torch.logsumexp(s, dim=-1)


def rel_err(out, ref):
    """Norm-wise relative error; the floor (an RMS of 1e-3) keeps exactly-zero
    references (e.g. dq, dk when every row attends to a single key) meaningful."""
    out, ref = out.double(), ref.double()
    floor = 1e-3 * ref.numel() ** 0.5
    return float((out - ref).norm() / ref.norm().clamp_min(floor))


def trains_like_eager(net, compiled, **inputs) -> int:
    """One training step of an HF model (its `.loss`) through `compiled`, then through `net` itself: the losses and
    parameter gradients must match (bf16 tolerances). Returns how many attention calls the compiled step replaced."""
    import tk_inductor

    def step(run):
        net.zero_grad(set_to_none=True)
        loss = run(**inputs).loss
        loss.backward()
        return loss.detach().float(), [p.grad.float() for p in net.parameters() if p.grad is not None]

    loss, grads = step(compiled)
    replaced = tk_inductor.report().replaced.get("attention", 0)
    loss_ref, grads_ref = step(net)
    torch.testing.assert_close(loss, loss_ref, atol=2e-2, rtol=2e-2)
    errs = [rel_err(g, r) for g, r in zip(grads, grads_ref)]
    assert max(errs) < 5e-2, errs
    return replaced


def poison(*shapes_dtypes):
    junk = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del junk


def make_inputs(B, Hq, Hkv, N, M, D, dtype, layout="bhnd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(H, S):
        if layout == "bnhd":  # HF style: (B, N, H, D) storage viewed as (B, H, N, D)
            return torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g)

    return rnd(Hq, N), rnd(Hkv, M), rnd(Hkv, M)


def check_forward(ops, q, k, v, causal, scale, window=0, cap=0.0):
    """tk_cuda::attention on q, k, v (outputs poisoned first) against the fp32 reference: o's (B, N, Hq, D) buffer,
    no NaN, o within OUT_TOL, lse close on rows that see a key and +inf on the others (the reference's -inf)."""
    B, Hq, N, D = q.shape
    poison(((B, N, Hq, D), q.dtype), ((B, Hq, N), torch.float32))
    o, lse = ops.attention(q, k, v, causal, scale, window, cap)
    torch.cuda.synchronize()
    assert o.shape == (B, Hq, N, D) and o.stride() == (N * Hq * D, D, Hq * D, 1)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    o_ref, lse_ref = reference(q, k, v, causal, scale, window, cap)
    assert rel_err(o, o_ref) < OUT_TOL
    rows = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[rows], lse_ref[rows], atol=2e-3, rtol=1e-4)
    assert torch.all(lse[~rows] == float("inf"))


def forward_cases():
    """Every (N, M) pair, causal and not; batch, GQA, head dim and dtype rotate so each value is covered often."""
    cases = []
    for i, ((N, M), causal) in enumerate(itertools.product(itertools.product(LENGTHS, LENGTHS), (False, True))):
        B = (1, 3)[i % 2]
        heads = ((4, 4), (4, 2), (4, 1))[i % 3]
        D = (64, 128)[(i // 2) % 2]
        dtype = (torch.bfloat16, torch.float16)[(i // 4) % 2]
        cases.append((B, *heads, N, M, D, dtype, causal))
    # every (D, dtype, GQA, causal) combination at an odd length
    for D, dtype, heads, causal in itertools.product((64, 128), (torch.bfloat16, torch.float16), ((4, 4), (8, 2)), (False, True)):
        cases.append((3, *heads, 1000, 1000, D, dtype, causal))
    return cases


def _id(c):
    B, Hq, Hkv, N, M, D, dtype, causal = c
    return f"B{B}-H{Hq}:{Hkv}-N{N}-M{M}-D{D}-{str(dtype)[6:]}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", forward_cases(), ids=_id)
def test_forward(ops, case):
    B, Hq, Hkv, N, M, D, dtype, causal = case
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, dtype)
    scale = 1.0 / math.sqrt(D)
    poison(((B, N, Hq, D), dtype), ((B, Hq, N), torch.float32))
    o, lse = ops.attention(q, k, v, causal, scale)
    torch.cuda.synchronize()
    assert o.shape == (B, Hq, N, D) and o.dtype == dtype
    assert o.stride() == (N * Hq * D, D, Hq * D, 1), "o must view a (B, N, Hq, D) buffer"
    assert lse.shape == (B, Hq, N) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    o_ref, lse_ref = reference(q, k, v, causal, scale)
    assert rel_err(o, o_ref) < OUT_TOL
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("case", [(3, 8, 2, 4096, 4096, D, torch.bfloat16, causal) for D in (64, 128)
                                  for causal in (False, True)], ids=_id)
def test_forward_many_tasks(ops, case):
    """Tasks enough that every block takes several: under a causal mask from the dynamic schedule's counter, each
    task exactly once; without one, the static shares."""
    test_forward(ops, case)


def replays_in_cuda_graph(ops, shape, causal, seeds):
    """tk_cuda::attention on inputs of `shape` (make_inputs' arguments) captured once in a CUDA graph, then replayed
    on new inputs copied into the captured ones (seeds[1:]): each replay equals the reference."""
    static = list(make_inputs(*shape, seed=seeds[0]))
    ops.attention(*static, causal, 0.088)  # load and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = ops.attention(*static, causal, 0.088)
    for seed in seeds[1:]:
        for dst, src in zip(static, make_inputs(*shape, seed=seed)):
            dst.copy_(src)
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = reference(*static, causal, 0.088)
        assert rel_err(o, o_ref) < OUT_TOL
        torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_forward_in_cuda_graph(ops, causal):
    """Captured once, replayed on new inputs: the dynamic schedule's counter (causal) is zeroed by a memset node in
    the graph, so every replay runs every task (a counter left at its end would leave the poisoned output)."""
    replays_in_cuda_graph(ops, (2, 8, 2, 1000, 1000, 128, torch.bfloat16), causal, (3, 4, 5))


@pytest.mark.parametrize("scale", [0.05, 1.0, -0.3, 0.0])  # -0.3 and 0: folded into q by the binding
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_forward_strides_and_scale(ops, layout, scale):
    q, k, v = make_inputs(2, 8, 2, 333, 517, 128, torch.bfloat16, layout=layout, seed=3)
    for causal in (False, True):
        o, lse = ops.attention(q, k, v, causal, scale)
        o_ref, lse_ref = reference(q, k, v, causal, scale)
        assert rel_err(o, o_ref) < OUT_TOL
        torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)


def backward_cases():
    cases = []
    pairs = [(1, 1), (17, 17), (128, 128), (1000, 1000), (17, 1000), (1000, 17), (128, 4096), (4096, 128), (1000, 4096),
             (200, 65), (129, 129)]
    for i, ((N, M), causal) in enumerate(itertools.product(pairs, (False, True))):
        B = (1, 3)[i % 2]
        heads = ((4, 4), (4, 2), (6, 1))[i % 3]
        D = (64, 128)[(i // 2) % 2]
        dtype = (torch.bfloat16, torch.float16)[(i // 4) % 2]
        cases.append((B, *heads, N, M, D, dtype, causal))
    for D, dtype, heads, causal in itertools.product((64, 128), (torch.bfloat16, torch.float16), ((4, 4), (8, 2)), (False, True)):
        cases.append((2, *heads, 777, 777, D, dtype, causal))
    return cases


@pytest.mark.parametrize("case", backward_cases(), ids=_id)
def test_backward(ops, case):
    from tk_inductor.ops.attention import grad_like

    B, Hq, Hkv, N, M, D, dtype, causal = case
    layout = ("bhnd", "bnhd")[(N + M + Hq) % 2]  # the gradients take the inputs' layout (grad_like)
    q, k, v = make_inputs(B, Hq, Hkv, N, M, D, dtype, layout=layout, seed=1)
    do = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(D)
    o, lse = ops.attention(q, k, v, causal, scale)
    poison(((B, Hq, N, D), dtype), ((B, Hkv, M, D), dtype), ((B, Hkv, M, D), dtype))
    dq, dk, dv = ops.attention_backward(do, q, k, v, o, lse, causal, scale)
    torch.cuda.synchronize()
    for t, like in ((dq, q), (dk, k), (dv, v)):
        assert t.shape == like.shape and t.dtype == dtype and t.stride() == grad_like(like).stride()
        assert not torch.isnan(t).any()

    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference(qr, kr, vr, causal, scale)
    o_ref.backward(do.float())
    for name, got, ref in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert rel_err(got, ref) < GRAD_TOL, f"{name}: relative error {rel_err(got, ref):.3e}"


@pytest.mark.parametrize("case", [(5, 4, 1, 4096, 4096, 128, torch.bfloat16, True),
                                  (3, 8, 2, 4096, 4096, 64, torch.float16, True),
                                  (3, 8, 2, 4096, 4096, 64, torch.bfloat16, False)], ids=_id)
def test_backward_many_blocks(ops, case):
    """GQA at N = 4096: under a causal mask the L2 cap makes several sections of heads (the last one short), without
    one the blocks run head by head; every (kv head, key block) block runs once."""
    test_backward(ops, case)


def test_backward_noncontiguous(ops):
    q, k, v = make_inputs(2, 8, 4, 300, 300, 64, torch.bfloat16, layout="bnhd", seed=5)
    do = torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    o, lse = ops.attention(q, k, v, True, 0.125)
    poison(((2, 8, 300, 64), torch.bfloat16), ((2, 4, 300, 64), torch.bfloat16), ((2, 4, 300, 64), torch.bfloat16))
    dq, dk, dv = ops.attention_backward(do, q, k, v, o, lse, True, 0.125)
    assert dq.stride() == (300 * 8 * 64, 64, 8 * 64, 1) and dk.stride() == (300 * 4 * 64, 64, 4 * 64, 1)
    assert dv.stride() == dk.stride() and not any(torch.isnan(t).any() for t in (dq, dk, dv))
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference(qr, kr, vr, True, 0.125)
    o_ref.backward(do.float())
    for got, ref in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert rel_err(got, ref) < GRAD_TOL


@pytest.mark.parametrize("D", [8, 32, 40, 72, 80, 96, 120])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_below_the_kernels(ops, D, causal):
    """Head dims other than 64 and 128 run the next kernel up, whose tensor maps zero-fill the columns past D:
    forward and backward, with GQA and the (B, N, H, D) layout, every output column written exactly once."""
    test_backward(ops, (2, 8, 2, 333, 333, D, torch.bfloat16, causal))
    q, k, v = make_inputs(3, 4, 4, 1000, 1000, D, torch.float16, layout="bnhd", seed=7)
    o, lse = ops.attention(q, k, v, causal, -0.2)  # folded into q: the columns past D are never stored
    o_ref, lse_ref = reference(q, k, v, causal, -0.2)
    assert rel_err(o, o_ref) < OUT_TOL
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda q, k, v: (q.float(), k.float(), v.float()), "bfloat16 or float16"),
        (lambda q, k, v: (q[..., :36], k[..., :36], v[..., :36]), "head dim"),
        (lambda q, k, v: (q[:, :3], k, v), "multiple of kv heads"),
        (lambda q, k, v: (q[0], k[0], v[0]), "4-D"),
    ],
)
def test_bad_inputs(ops, bad, message):
    q, k, v = make_inputs(1, 4, 2, 64, 64, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        ops.attention(*bad(q, k, v), False, 0.125)


@pytest.mark.parametrize("amp", [False, True], ids=["bf16", "autocast"])
def test_compiled_graphs_call_the_kernels_directly(amp):
    """Through the backend, the post-grad pass makes the attention nodes call tk_cuda:: (no Python op per call),
    in the forward and the backward graph, and values and gradients match eager."""
    import torch.nn.functional as F
    from torch._inductor import config as inductor_config

    import tk_inductor

    seen = []
    g = torch.Generator(device="cuda").manual_seed(3)
    dtype = torch.float32 if amp else torch.bfloat16
    x = torch.randn(2, 300, 256, generator=g, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(256, 768, generator=g, device="cuda") / 16).to(dtype).requires_grad_()

    def f(x, w):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            q, k, v = (x @ w).view(2, 300, 3, 4, 64).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return o.transpose(1, 2).reshape(2, 300, 256)

    with inductor_config.patch(post_grad_custom_post_pass=lambda gr: seen.append(
            {str(n.target) for n in gr.nodes if n.op == "call_function"})):
        torch._dynamo.reset()
        out = torch.compile(f, backend="thunderkittens")(x, w)
        grads = torch.autograd.grad(out.float().square().sum(), (x, w))
    assert "attention" in str(tk_inductor.report())
    forward, backward = seen[0], seen[-1]
    assert "tk_cuda.attention.default" in forward and "tk.attention.default" not in forward, forward
    assert "tk_cuda.attention_backward.default" in backward, backward
    eager = f(x, w)
    ref = torch.autograd.grad(eager.float().square().sum(), (x, w))
    assert out.dtype == eager.dtype and rel_err(out, eager) < OUT_TOL
    for got, want in zip(grads, ref):
        assert got.dtype == want.dtype and rel_err(got, want) < GRAD_TOL


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_and_sinks(ops, monkeypatch, D, causal):
    """The backward with lse's gradient (grad_lse: delta - grad_lse in the pre kernel), through gpt-oss's attention
    sinks (o·σ(lse − sink), attention_sink_adapter): forward and every gradient, the sinks' included, against the
    fp32 softmax over the concatenated logits."""
    from kernel_checks import record_raw_calls
    from tk_inductor.ops.attention import attention_sink_adapter

    calls = record_raw_calls(monkeypatch)
    B, Hq, Hkv, N = 2, 8, 2, 1000
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(B, Hq, Hkv, N, N, D, torch.bfloat16, seed=D))
    sink = torch.randn(Hq, device="cuda", requires_grad=True)
    scale = D ** -0.5
    out = attention_sink_adapter(q, k, v, causal, scale, 0, 0.0, sink.reshape(1, -1, 1, 1), (False, False, False))
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), do)
    assert calls == ["attention", "attention_backward"]
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    sr = sink.detach().clone().requires_grad_()
    kf, vf = kr.repeat_interleave(Hq // Hkv, 1), vr.repeat_interleave(Hq // Hkv, 1)
    s = qr @ kf.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    logits = torch.cat([s, sr.reshape(1, -1, 1, 1).expand(B, Hq, N, 1)], -1)
    want = logits.softmax(-1)[..., :-1] @ vf
    assert rel_err(out, want) < OUT_TOL
    refs = torch.autograd.grad(want, (qr, kr, vr, sr), do.float())
    for name, got, ref in zip(("dq", "dk", "dv", "dsink"), grads, refs):
        assert rel_err(got, ref) < GRAD_TOL, f"{name}: relative error {rel_err(got, ref):.3e}"
