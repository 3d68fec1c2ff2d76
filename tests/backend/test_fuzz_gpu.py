"""Random valid configurations of every kernel family on the GPU, forward and backward, against the references.

Each family draws `--fuzz N` configurations (default 100; the recorded runs use 1000) from `--fuzz-seed`, all inside
what its kernels take: odd and tiny sizes (1, 2, 17, ...) and sizes past 1000, GQA ratios, every dtype combination the
kernels accept, each feature flag, and operands in other layouts: transposed middle dims, rows padded wider than
they are, views at a storage offset (unaligned for odd offsets), and a non-unit last stride.

Per configuration the public `tk::` op runs under `strict`, with a spy on the raw kernels: a configuration that
reached the PyTorch reference instead of a kernel fails. Its gradients come from autograd through the op (the
backward kernels). Before each call the caching allocator is left holding 0xFF-filled free blocks of every operand's
size, NaN in fp32, fp16 and bf16, so an element a kernel does not write shows up as NaN. The truth is the same op in
reference mode on the same inputs (fp32 arithmetic, the same roundings of stored intermediates).

Tolerances (`TOL`): the norm-wise relative error of each output and gradient, the bounds the family's own GPU tests
use; and elementwise, |got - want| <= 10 tol (|want| + rms(want)), which catches a wrong row or block that a norm
hides. On top of both: twice the error the kernels' design is known to add (`delta_error`: dq and dk of attention
and normalized linear attention), and four times how far 16-bit roundings of the inputs move the reference
(`sensitivity`: ill-conditioned results). Sums of many signed terms (the SSD's dA and dD, a row's mean) are measured
at the scale of their terms. A failure names its seed: `--fuzz 1 --fuzz-seed <seed>` reruns it alone."""
from __future__ import annotations

import math
import random

import pytest
import torch

from tk_inductor import build, config
from tk_inductor.ops import _dispatch
from tk_inductor.ops import layernorm as ln_ops
from tk_inductor.ops import ssd as _ssd_ops  # noqa: F401  (registers tk::ssd)

pytestmark = pytest.mark.gpu

# norm-wise relative error bounds by family and output dtype: (outputs, gradients)
TOL = {
    "attention": (1e-2, 2e-2),  # P in 16 bits on the tensor cores
    "linear_attention": (1e-2, 2e-2),  # bf16 feature products
    "ssd": (2e-2, 3e-2),  # bf16 operands of every product, fp32 states
    torch.float32: (1e-4, 1e-4),  # rotary and layernorm: fp32 arithmetic, the result rounded once
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}


@pytest.fixture
def fuzz(request):
    return request.config.getoption("--fuzz"), request.config.getoption("--fuzz-seed")


@pytest.fixture
def calls(monkeypatch):
    """The raw kernels the ops call, in order (a spy on _dispatch.kernel)."""
    seen = []
    real = _dispatch.kernel

    def spy(name):
        seen.append(name)
        return real(name)

    monkeypatch.setattr(_dispatch, "kernel", spy)
    return seen


# ---------------------------------------------------------------------------- shared helpers

def pick(rng: random.Random, *choices):
    return rng.choice(choices)


def size(rng: random.Random, large: int = 1100) -> int:
    """Tiny, odd, round and large sizes."""
    return pick(rng, 1, 2, 3, 17, rng.randint(1, 64), rng.randint(1, 300), 64, 128, 256, rng.randint(900, large))


def place(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t's values in the given memory layout, as a leaf that can require grad."""
    if layout == "contiguous" or t.dim() == 0:
        out = t.clone()
    elif layout == "permuted" and t.dim() >= 3:  # e.g. (B, N, H, D) memory seen as (B, H, N, D)
        out = t.transpose(-2, -3).contiguous().transpose(-2, -3)
    elif layout.startswith("wide"):  # rows padded wider: a slice of a fused buffer such as qkv
        pad = int(layout[4:])
        out = torch.empty(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device)[..., :t.shape[-1]]
        out.copy_(t)
    elif layout.startswith("offset"):  # a contiguous view at a storage offset
        off = int(layout[6:])
        out = torch.empty(t.numel() + off, dtype=t.dtype, device=t.device)[off:].view(t.shape).copy_(t)
    elif layout == "column" and t.dim() >= 2:  # the last dim not unit-stride
        out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:
        out = t.clone()
    return out.detach()


LAYOUTS = ("contiguous", "contiguous", "permuted", "wide8", "wide3", "offset8", "offset1", "column")


def rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item() if t.numel() else 0.0


def poison(*tensors: torch.Tensor) -> None:
    """Leave 0xFF-filled free blocks (NaN in every float dtype) of these tensors' sizes in the caching allocator."""
    blocks = [torch.full((max(t.numel() * t.element_size(), 1),), 255, dtype=torch.uint8, device="cuda")
              for t in tensors for _ in range(2)]
    del blocks


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, extra=None, sens=None) -> str | None:
    """None if got matches want (dtype, shape, values), else what is wrong. On top of the tolerance: `extra`, a
    known per-element error of the kernel's design (`delta_error`), and `sens`, how far roundings at the kernel's
    precision move the value (`sensitivity`)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    if got.numel() == 0:
        return None
    g, w = got.double(), want.double()
    if not torch.isfinite(g).all():
        return f"{name}: {int((~torch.isfinite(g)).sum())} non-finite elements (unwritten?)"
    extra = torch.zeros_like(w) if extra is None else 2 * extra.double().abs()
    if sens is not None:
        extra = extra + 4 * (sens.double() + rms(sens))
    err, allowed = (g - w).norm().item(), tol * w.norm().item() + extra.norm().item()
    if err > allowed:
        return f"{name}: error {err:.3g} > {allowed:.3g} (relative {err / max(w.norm().item(), 1e-30):.3g})"
    worst = ((g - w).abs() - 10 * tol * (w.abs() + rms(w)) - extra).max().item()
    if worst > 0:
        return f"{name}: an element is off by {worst:.3g} beyond 10 tol (|want| + rms)"
    return None


def delta_error(family: str, case: dict, got, want_args, douts) -> dict:
    """The error the kernels' design puts into dq and dk, which the reference does not have: attention and
    normalized linear attention subtract Δ_i = do_i·o_i, formed (as in FlashAttention) from the 16-bit o the forward
    stored, so Δ is off by δΔ_i = do_i·(o_i - o_i exact). In attention that adds -δΔ_i ∂lse_i to the gradients of q
    and k, in normalized linear attention -δΔ_i/(den_i + eps) ∂den_i, and there the other side of the difference,
    do_i/(den_i + eps), is rounded to bf16 as well (bounded: half an ulp), and both sides come from bf16 products
    (2^-8 of the plain term). Gradients that are zero in exact arithmetic (one key, the first position) carry these
    errors whole. Computed here from the fp32 reference by autograd (attention's fp32 summation error as a bound)."""
    if family not in ("attention", "linear_attention") or (family == "linear_attention" and not want_args[7]):
        return {}
    q, k, v = (t.detach().float().requires_grad_() for t in want_args[:3])
    if family == "attention":
        from tk_inductor.ops.attention import _scores, attention_reference
        sc = case["scores"]
        causal, scale, window, cap, mask = sc["causal"], sc["scale"], sc["window"], sc["cap"], sc.get("mask")
        o, lse = attention_reference(q, k, v, causal, scale, window, cap, mask)
        if sc.get("sink") is not None:  # the kernel's o and do are o·σ(lse − sink)'s factors: its Δ error is do·δ(o·σ)
            o = o * torch.sigmoid(lse.detach() - sc["sink"].squeeze(-1)).unsqueeze(-1)
        prod = douts[0].float() * (got[0].float() - o.detach())
        dq, dk = torch.autograd.grad((-prod.sum(-1) * lse).sum(), (q, k))
        # plus the fp32 sums of Δ and of dP = do·v (all there is where o is exact, as at one key, where the two
        # cancel): D additions, each off by up to an ulp of the running sum on the tensor cores' truncating adders.
        # Unsigned, so through |∂lse_i/∂q_i| = |scale| Σ_j p_ij |k_j| and |∂lse_i/∂k_j| = |scale| p_ij |q_i| (a softcap
        # only scales these by 1 - tanh² <= 1).
        B, Hkv, M, D = k.shape
        group = q.shape[1] // Hkv
        with torch.no_grad():
            bound = D * 2 ** -23 * (douts[0].float() * o).abs().sum(-1)
            s = _scores(q, k, causal, scale, mask, window, cap)[0]
            p = torch.exp(s - lse.unsqueeze(-1)) * (abs(scale) * bound).unsqueeze(-1)
            dq_bound = p @ k.abs().repeat_interleave(group, dim=1)
            dk_bound = (p.transpose(-1, -2) @ q.abs()).view(B, Hkv, group, M, D).sum(2)
        return {"dq": dq.abs() + dq_bound, "dk": dk.abs() + dk_bound}
    else:
        from tk_inductor.ops.linear_attention import linear_attention_reference as ref
        scale, eps = want_args[6], want_args[8]
        o = ref(q, k, v, "based", None, None, scale, True, eps)
        den = ref(q, k, torch.ones_like(v[..., :1]), "based", None, None, scale, False, 0.0)[..., 0]
        inv = 1 / (den.detach() + eps)
        c = -(douts[0].float() * (got[0].float() - o.detach())).sum(-1) * inv
        dq, dk = torch.autograd.grad((c * den).sum(), (q, k))
        # the kernel also rounds dn = do/(den + eps) to bf16 for its products with v. Its den is its own fp32 sum,
        # a few ulps from this one, so which way each element rounds cannot be reproduced here: the bound, half an
        # ulp (2^-9 |dn|), through the gradient of the unnormalized sum Σ_j κ_ij |v_j|
        dn = douts[0].float() * inv.unsqueeze(-1)
        plain_abs = ref(q, k, v.detach().abs(), "based", None, None, scale, False, 0.0)
        dq2, dk2 = torch.autograd.grad(plain_abs, (q, k), 2 ** -9 * dn.abs())
        # and the two sides of the difference, each the size of the plain term, are formed from bf16 products
        plain = ref(q, k, v, "based", None, None, scale, False, 0.0)
        dq3, dk3 = torch.autograd.grad(plain, (q, k), dn)
        return {"dq": dq.abs() + dq2.abs() + 2 ** -8 * dq3.abs(), "dk": dk.abs() + dk2.abs() + 2 ** -8 * dk3.abs()}


# the relative size of the roundings inside each family's tile products (16-bit operands on the tensor cores)
KERNEL_EPS = {"attention": None, "linear_attention": 2.0 ** -8, "ssd": 2.0 ** -8}  # None: the inputs' own dtype


def sensitivity(family: str, case: dict, args, douts) -> tuple[list, dict]:
    """How far the kernel's own roundings can move each output and gradient: |reference(inputs ⊙ (1 + ε u)) -
    reference(inputs)| for u uniform in [-1, 1] and ε the precision of the kernel's 16-bit tile products, the
    larger of two draws, all in fp32. It is large where a result is ill-conditioned, such as a sum whose terms
    cancel ((1 + s) near zero in Based's gradients, a softmax row of one key) and small elsewhere."""
    if family not in KERNEL_EPS:
        return [], {}
    floats = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    eps = KERNEL_EPS[family] or torch.finfo(args[0].dtype).eps

    def reference(noise: bool):
        full = list(args)
        for i in floats:
            t = args[i].detach().float()
            full[i] = (t * (1 + eps * (2 * torch.rand_like(t) - 1)) if noise else t).requires_grad_(i in case["grad_inputs"])
        with config.patch(reference=True):
            out = case["op"](*full)
            grads = torch.autograd.grad([out[i] for i in case["outputs"]], [full[i] for i in case["grad_inputs"]],
                                        [d.float() for d in douts], allow_unused=True)
        return [o.detach().float() for o in out if isinstance(o, torch.Tensor)], list(grads)

    base_out, base_grads = reference(False)
    outs, grads = None, None
    for _ in range(2):
        o2, g2 = reference(True)
        d_out = [(a - b).abs() for a, b in zip(o2, base_out)]
        d_grad = [None if a is None else (a - b).abs() for a, b in zip(g2, base_grads)]
        outs = d_out if outs is None else [torch.maximum(a, b) for a, b in zip(outs, d_out)]
        grads = d_grad if grads is None else [None if a is None else torch.maximum(a, b) for a, b in zip(grads, d_grad)]
    return outs, dict(zip(case["grad_names"], grads))


def run(family: str, build_case, n: int, seed0: int, calls: list) -> None:
    """Draw n configurations and check each; one failure report for all."""
    build.load(family)
    failures, backward_kernels = [], set()
    for i in range(n):
        seed = seed0 + i
        rng = random.Random(seed)
        torch.manual_seed(seed)
        case = build_case(rng)
        print(f"seed {seed}: {case['desc']}", flush=True)  # the last line names the configuration if a crash stops the run
        calls.clear()
        try:
            problems = check_case(family, case, calls)
        except Exception as e:  # noqa: BLE001: a crash in one configuration is a failure like any other
            problems = [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"]
            torch.cuda.synchronize()  # a sticky CUDA error surfaces here and fails the test outright
        backward_kernels.update(c for c in calls if c.endswith("backward"))
        if problems:
            failures.append(f"seed {seed}: {case['desc']}: " + "; ".join(problems))
    print(f"\nfuzz {family}: {n} configurations, {len(failures)} failures, kernels {sorted(backward_kernels)}")
    assert not failures, f"{len(failures)} of {n} configurations failed:\n" + "\n".join(failures[:25])


def check_case(family: str, case: dict, calls: list) -> list[str]:
    op, args, grads_of = case["op"], case["args"], case["grad_inputs"]
    leaves = [args[i] for i in grads_of]
    for t in leaves:
        t.requires_grad_()
    poison(*[a for a in args if isinstance(a, torch.Tensor)])
    with config.patch(strict=True):
        got = op(*args)
    if family not in calls:  # each family's forward kernel is named after it
        return [f"the forward ran the reference (kernels called: {calls})"]
    forward_calls = len(calls)
    outs = [got[i] for i in case["outputs"]]
    douts = [torch.randn(o.shape, device="cuda").to(o.dtype) for o in outs]
    poison(*leaves, *outs)
    with config.patch(strict=True):
        grads = torch.autograd.grad(outs, leaves, douts, allow_unused=True) if leaves else []
    torch.cuda.synchronize()
    if leaves and len(calls) == forward_calls and case.get("backward_kernel", True):
        return [f"the backward ran the reference (kernels called: {calls})"]

    ref_args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    with config.patch(reference=True):
        want = op(*ref_args)
        want_grads = torch.autograd.grad([want[i] for i in case["outputs"]], [ref_args[i] for i in grads_of], douts,
                                         allow_unused=True) if leaves else []
    sens_out, sens_grad = sensitivity(family, case, ref_args, douts)
    problems = []
    for i, (a, b) in enumerate(zip(got, want)):
        if not isinstance(a, torch.Tensor) or i in case.get("unchecked", ()):
            continue
        if i in case.get("out_check", {}):
            problems.append(case["out_check"][i](a, b, want))
            continue
        problems.append(compare(f"output {i}", a, b, case.get("out_tol", {}).get(i, case["tol"][0]),
                                sens=sens_out[i] if i < len(sens_out) else None))
        strides = [(sa, sb) for n_, sa, sb in zip(a.shape, a.stride(), b.stride()) if n_ > 1]
        if any(sa != sb for sa, sb in strides):  # the layout the fake implementation promises, as the reference's
            problems.append(f"output {i}: strides {a.stride()}, the reference gives {b.stride()}")
    names = case["grad_names"]
    want_by_name = dict(zip(names, want_grads))
    known = delta_error(family, case, got, ref_args, douts) if leaves else {}
    for name, a, b in zip(names, grads, want_grads):
        if a is None or b is None:
            if (a is None) != (b is None):
                problems.append(f"{name}: {'missing' if a is None else 'unexpected'}")
            continue
        special = case.get("grad_check", {}).get(name)
        if special:
            problems.append(special(a, b, dict(args=ref_args, grads=want_by_name, douts=douts)))
        else:
            problems.append(compare(name, a, b, case.get("grad_tol", {}).get(name, case["tol"][1]), known.get(name),
                                    sens_grad.get(name)))
    return [p for p in problems if p]


def randn(shape, dtype, scale=1.0, layout="contiguous"):
    return place((torch.randn(shape, device="cuda") * scale).to(dtype), layout)


# ---------------------------------------------------------------------------- attention

def attention_case(rng):
    from tk_inductor.ops import attention as ops

    B, Hkv, ratio = pick(rng, 1, 1, 2, 3), pick(rng, 1, 2, 3, 4), pick(rng, 1, 1, 2, 3, 4, 8)
    N = size(rng)
    M = N if rng.random() < 0.6 else size(rng)
    D, dtype = pick(rng, *ops.KERNEL_HEAD_DIMS), pick(rng, *ops.KERNEL_DTYPES)
    causal, scale = rng.random() < 0.5, rng.uniform(0.5, 1.5) / math.sqrt(D)
    lay = [pick(rng, *LAYOUTS) for _ in range(3)]
    masked = rng.random() < 0.2  # tk::attention_masked with a mask the run-time check proves causal / all-visible
    # MLA: v's own head dim (tk::attention pads q/k and v to the larger, a kernel head dim as both are)
    Dv = pick(rng, *ops.KERNEL_HEAD_DIMS) if not masked and rng.random() < 0.25 else D
    q = randn((B, Hkv * ratio, N, D), dtype, 1.0, lay[0])
    k, v = randn((B, Hkv, M, D), dtype, 1.0, lay[1]), randn((B, Hkv, M, Dv), dtype, 1.0, lay[2])
    # a window leaves rows past M + window - 1 with no key (N > M): those rows are NaN in the kernel and reference alike
    window = pick(rng, 1, 17, 128, 200, size(rng)) if causal and N <= M and not masked and rng.random() < 0.3 else 0
    cap = pick(rng, 1.0, 5.0, 30.0) if not masked and rng.random() < 0.3 else 0.0
    # a two-sided window (encoders; tk::attention_varlen's tables) or gpt-oss's sinks (o·σ(lse − sink), lse's gradient)
    band = pick(rng, 1, 17, 128, size(rng)) if not causal and not masked and N == M and Dv == D \
        and rng.random() < 0.2 else 0
    sinks = not masked and not band and rng.random() < 0.2
    desc = (f"B{B} Hq{Hkv * ratio} Hkv{Hkv} N{N} M{M} D{D} Dv{Dv} {dtype} causal={causal} window={window} "
            f"softcap={cap} masked={masked} two-sided={band} sinks={sinks} layouts {lay}")
    grad_inputs, grad_names, outputs = [0, 1, 2], ["dq", "dk", "dv"], [0]
    scores = dict(causal=causal, scale=scale, window=window, cap=cap)  # for delta_error's reference
    if masked:
        mask = torch.ones(N, M, dtype=torch.bool, device="cuda")
        mask = mask.tril() if causal else mask
        op = lambda q, k, v, mask, s: torch.ops.tk.attention_masked(q, k, v, mask, s)  # noqa: E731
        args = [q, k, v, mask, scale]
        scores.update(cap=0.0, window=0)
    elif band:
        op = lambda q, k, v, s, w, cap: torch.ops.tk.attention_varlen(q, k, v, None, None, False, s, w, cap)  # noqa: E731
        args = [q, k, v, scale, band, cap]
        i = torch.arange(N, device="cuda")
        scores.update(causal=False, window=0, mask=(i[:, None] - i[None, :]).abs() < band)
    elif sinks:
        def op(q, k, v, c, s, w, cap, sink):
            return (ops.attention_sink_adapter(q, k, v, c, s, w, cap, sink, (False, False, False)),)
        args = [q, k, v, causal, scale, window, cap, torch.randn(1, Hkv * ratio, 1, 1, device="cuda")]
        scores.update(sink=args[-1])
        grad_inputs, grad_names = [0, 1, 2, 7], ["dq", "dk", "dv", "dsink"]
    else:
        op = lambda q, k, v, c, s, w, cap: torch.ops.tk.attention(q, k, v, c, s, w, cap)  # noqa: E731
        args = [q, k, v, causal, scale, window, cap]
    return dict(desc=desc, op=op, args=args, outputs=outputs, grad_inputs=grad_inputs, tol=TOL["attention"], scores=scores,
                grad_names=grad_names, out_tol={1: 5e-4},
                backward_kernel=ops.kernel_supports(dtype, max(D, Dv), backward=True) is None,
                unchecked=(1,) if masked else ())  # the masked op's reference (SDPA with the mask) has no lse


# ---------------------------------------------------------------------------- rotary

def rotary_case(rng):
    from tk_inductor.ops import rotary as ops

    x_dtype = pick(rng, torch.float32, torch.bfloat16, torch.float16)
    table = pick(rng, x_dtype, torch.float32)
    outs = [o for o in (torch.float32, torch.bfloat16, torch.float16) if ops.kernel_supports(x_dtype, table, o)]
    out_dtype = pick(rng, *outs)
    promoted = torch.promote_types(x_dtype, table)
    B, H, N = pick(rng, 1, 2, 3), pick(rng, 1, 2, 5, 8, 32), size(rng, 2100)
    Hk = pick(rng, None, H, 1, max(1, H // 4))  # None: q alone
    D = pick(rng, 2, 8, 16, 32, 64, 80, 96, 128, 256, 2 * rng.randint(1, 64))
    rd = pick(rng, D, D, 2 * rng.randint(1, D // 2))
    heads_first, rank = rng.random() < 0.5, pick(rng, 4, 4, 3)
    interleaved, backward, contiguous = (rng.random() < 0.5 for _ in range(3))

    def shape(h):  # (B, H, N, D) or (B, N, H, D), without B at rank 3
        s = (B, h, N, D) if heads_first else (B, N, h, D)
        return s[4 - rank:]

    lay = [pick(rng, *LAYOUTS) for _ in range(3)]
    q = randn(shape(H), x_dtype, 1.0, lay[0])
    k = randn(shape(Hk), x_dtype, 1.0, lay[1]) if Hk else None
    per_batch = rank == 4 and rng.random() < 0.5  # HF: (B, N, rd), unsqueezed at the heads dim
    angle = torch.rand((B, N, rd // 2) if per_batch else (N, rd // 2), device="cuda") * 6.3
    angle = angle.repeat_interleave(2, -1) if interleaved else torch.cat([angle, angle], -1)
    if per_batch or not heads_first:
        angle = angle.unsqueeze(-3 if heads_first else -2)
    cos, sin = place(angle.cos().to(table), lay[2]), place(angle.sin().to(table), lay[2])
    explicit = out_dtype if out_dtype != promoted or rng.random() < 0.3 else None
    desc = (f"q {tuple(q.shape)} k {None if k is None else tuple(k.shape)} rd{rd} x {x_dtype} table {table} "
            f"out {out_dtype} interleaved={interleaved} backward={backward} contiguous={contiguous} "
            f"cos {tuple(cos.shape)} layouts {lay}")
    op = lambda *a: torch.ops.tk.rotary(*a)  # noqa: E731
    args = [q, k, cos, sin, interleaved, backward, contiguous, explicit]
    return dict(desc=desc, op=op, args=args, outputs=[0, 1] if k is not None else [0],
                grad_inputs=[0, 1] if k is not None else [0], tol=TOL[out_dtype], grad_names=["dq", "dk"],
                grad_tol={"dq": TOL[x_dtype][1], "dk": TOL[x_dtype][1]})


# ---------------------------------------------------------------------------- layernorm

def layernorm_case(rng):
    hidden = pick(rng, 8, 16, 136, 256, 520, 1024, 1032, 2048, 3000, 4096, 5000, 6144, 8192, 16384,
                  8 * rng.randint(1, 2048))
    rows = pick(rng, 1, 2, 17, rng.randint(1, 300), rng.randint(900, 1100)) if hidden <= 4096 else \
        pick(rng, 1, 3, rng.randint(1, 200))
    lead = (rows,) if rng.random() < 0.5 else ((1, rows) if rows % 2 else (2, rows // 2))
    rms, gated = rng.random() < 0.5, rng.random() < 0.2
    x_dtype = pick(rng, torch.float32, torch.bfloat16, torch.float16)
    residual = not gated and rng.random() < 0.6
    h_dtype = pick(rng, x_dtype, torch.float32) if residual else x_dtype
    if gated:
        h_dtype = torch.float32
    if gated:
        y_choices = [y for y in (torch.float32, torch.bfloat16, torch.float16) if ln_ops.gate_supported(None, y)]
    else:
        y_choices = [y for y in (torch.float32, torch.bfloat16, torch.float16)
                     if ln_ops.kernel_supports(x_dtype, h_dtype, None, y)]
    y_dtype = pick(rng, *y_choices)
    w_dtype = pick(rng, None, torch.float32, y_dtype)
    bias = not rms and w_dtype is not None and rng.random() < 0.6
    p = 0.0 if gated or rng.random() < 0.6 else pick(rng, 0.1, 0.5)
    stats = rng.random() < 0.9
    lay = pick(rng, *LAYOUTS)
    shape = lead + (hidden,)
    x = randn(shape, x_dtype, 1.0, lay)
    r = randn(shape, h_dtype, 1.0, pick(rng, *LAYOUTS)) if residual else None
    w = randn((hidden,), w_dtype, 1.0) if w_dtype is not None else None
    b = randn((hidden,), w_dtype, 1.0) if bias else None
    gate_dtype = pick(rng, torch.float32, torch.bfloat16, torch.float16)
    gate = randn(shape, gate_dtype, 1.0, pick(rng, *LAYOUTS)) if gated else None
    rng_state = torch.tensor([rng.randint(0, 2**40), 4 * rng.randint(0, 1000)], dtype=torch.int64) if p else None
    explicit = y_dtype if y_dtype != h_dtype or rng.random() < 0.3 else None
    eps = pick(rng, 1e-5, 1e-6, 0.1)
    desc = (f"{tuple(shape)} rms={rms} x {x_dtype} h {h_dtype} y {y_dtype} w {w_dtype} bias={bias} "
            f"residual={residual} gated={gated} p={p} stats={stats} layout {lay}")
    args = [x, r, w, b, rng_state, eps, p, rms, stats, explicit, gate]
    present = [i for i in (0, 1, 2, 3, 10) if args[i] is not None]
    names = {0: "dx", 1: "dresidual", 2: "dw", 3: "db", 10: "dgate"}
    has_h = residual or p > 0
    return dict(desc=desc, op=lambda *a: torch.ops.tk.layernorm(*a), args=args,
                outputs=([0, 1] if has_h else [0]) if stats else [], grad_inputs=present if stats else [],
                tol=TOL[y_dtype], grad_names=[names[i] for i in present],
                grad_tol={"dx": TOL[x_dtype][1], "dresidual": TOL[h_dtype][1], "dgate": TOL[gate_dtype][1],
                          "dw": 4 * TOL[w_dtype or y_dtype][1], "db": 4 * TOL[w_dtype or y_dtype][1]},
                out_tol={1: TOL[h_dtype][0], 3: 1e-5}, out_check={2: ln_mean}, unchecked=(4,))


def ln_mean(got, want, outs):
    """A row's mean that is small next to the row's spread is a cancellation: its error is measured at the scale of
    the row's standard deviation (1/rstd) plus its own size."""
    if got.dtype != want.dtype or got.shape != want.shape or not torch.isfinite(got).all():
        return f"mean: {got.dtype} {tuple(got.shape)} (finite: {bool(torch.isfinite(got).all())}), want {want.dtype}"
    err = ((got.double() - want.double()).abs() / (want.double().abs() + 1 / outs[3].double())).max().item() \
        if got.numel() else 0.0
    return None if err < 1e-5 else f"mean: error {err:.3g} at the row's scale"


# ---------------------------------------------------------------------------- linear attention

def linear_attention_case(rng):
    from tk_inductor.ops import linear_attention as ops

    B, H, N = pick(rng, 1, 2, 3), pick(rng, 1, 2, 4, 16), size(rng, 2100)
    dv = pick(rng, 64, 64, 128, 192, 256)
    fm = pick(rng, "based", "based", "elu1", "identity")
    dk = pick(rng, *ops.KERNEL_DK[fm])
    normalize = rng.random() < 0.5
    scale, eps = pick(rng, 0.25, rng.uniform(0.1, 0.5)), pick(rng, 1e-6, 1e-3)
    lay = [pick(rng, *LAYOUTS) for _ in range(3)]
    q = randn((B, H, N, dk), torch.bfloat16, 1.0, lay[0])
    k = randn((B, H, N, dk), torch.bfloat16, 1.0, lay[1])
    v = randn((B, H, N, dv), torch.bfloat16, 1.0, lay[2])
    if fm == "identity" and normalize:  # already-mapped (positive) features: a denominator near zero tests nothing
        q, k = q.abs(), k.abs()
    desc = f"{fm} B{B} H{H} N{N} dk{dk} dv{dv} normalize={normalize} scale={scale:.3g} eps={eps:g} layouts {lay}"
    op = lambda *a: torch.ops.tk.linear_attention(*a)  # noqa: E731
    return dict(desc=desc, op=op, args=[q, k, v, fm, None, None, scale, normalize, eps], outputs=[0],
                grad_inputs=[0, 1, 2], tol=TOL["linear_attention"], grad_names=["dq", "dk", "dv"])


# ---------------------------------------------------------------------------- ssd

def ssd_da(got, want, ctx):
    """A's gradient is the sum over every (batch, token) of dt·da (da: the gradient of a = dt·A), terms of both
    signs that cancel to a small fraction of their size, so its error is measured against Σ |dt|·(|da| + |x·dX|/|A|)
    per head, the scale its bf16 terms are rounded at (as test_ssd_gpu.da_error, with the input term). da comes from the reference's gradients:
    ddt = Σ_p x·dX + A·da with dx = dt·dX + D·dy."""
    x, dt, A, _, _, D = (None if t is None else t.detach().double() for t in ctx["args"][:6])
    dy, grads = ctx["douts"][0].double(), {k: v.double() for k, v in ctx["grads"].items()}
    dX = (grads["dx"] - (0 if D is None else D.view(1, 1, -1, 1) * dy)) / dt.unsqueeze(-1)
    xdX = (x * dX).sum(-1)
    da = (grads["ddt"] - xdX) / A
    # the terms' scale: |da| itself, and the input term it is separated from in ddt (da is zero at l = 1 with no
    # initial state, where the kernel's dA is the rounding of that separation)
    scale = (dt * (da.abs() + xdX.abs() / A.abs())).sum((0, 1))
    err = ((got.double() - want.double()).norm() / scale.norm().clamp_min(1e-30)).item()
    return None if err < TOL["ssd"][1] else f"dA: relative error {err:.3g} at its terms' scale"


def ssd_dd(got, want, ctx):
    """D's gradient is Σ over (batch, token, head dim) of dy·x, terms of both signs: its error is measured against
    their root sum of squares per head, the size of a sum of independently rounded terms."""
    x, dy = ctx["args"][0].detach().double(), ctx["douts"][0].double()
    scale = (dy * x).pow(2).sum((0, 1, 3)).sqrt()
    err = ((got.double() - want.double()).norm() / scale.norm().clamp_min(1e-30)).item()
    return None if err < TOL["ssd"][1] else f"dD: relative error {err:.3g} at its terms' scale"


def ssd_case(rng):
    b, l = pick(rng, 1, 2, 3), size(rng, 2100)
    ng = pick(rng, 1, 1, 2, 4)
    nh = ng * pick(rng, 1, 2, 3, 8)
    # the kernels' own sizes, and (through tk::ssd, in parts: ops/_state_parts.py) others
    p, n = pick(rng, 64, 64, 128, 192, 32, 96), pick(rng, 16, 32, 64, 128, 128, 48, 256)
    x_dtype = pick(rng, torch.bfloat16, torch.bfloat16, torch.float16, torch.float32)
    dt_dtype = pick(rng, torch.float32, x_dtype)
    with_d, with_h0 = rng.random() < 0.6, rng.random() < 0.4
    lay = [pick(rng, *LAYOUTS) for _ in range(4)]
    x = randn((b, l, nh, p), x_dtype, 1.0, lay[0])
    dt = place(torch.nn.functional.softplus(torch.randn(b, l, nh, device="cuda") - 1.0).to(dt_dtype), lay[1])
    A = place(-torch.rand(nh, device="cuda") * 2 - 0.05, "contiguous")
    B = randn((b, l, ng, n), x_dtype, n ** -0.5, lay[2])
    C = randn((b, l, ng, n), x_dtype, 1.0, lay[3])
    D = randn((nh,), torch.float32) if with_d else None
    h0 = randn((b, nh, p, n), torch.float32) if with_h0 else None
    desc = f"b{b} l{l} nh{nh} ng{ng} p{p} n{n} x {x_dtype} dt {dt_dtype} D={with_d} h0={with_h0} layouts {lay}"
    args = [x, dt, A, B, C, D, h0, 64]
    present = [i for i in range(7) if args[i] is not None]
    names = {0: "dx", 1: "ddt", 2: "dA", 3: "dB", 4: "dC", 5: "dD", 6: "dh0"}
    return dict(desc=desc, op=lambda *a: torch.ops.tk.ssd(*a), args=args, outputs=[0, 1], grad_inputs=present,
                tol=TOL["ssd"], grad_names=[names[i] for i in present], grad_check={"dA": ssd_da, "dD": ssd_dd})


CASES = {"attention": attention_case, "rotary": rotary_case, "layernorm": layernorm_case,
         "linear_attention": linear_attention_case, "ssd": ssd_case}


@pytest.mark.parametrize("family", list(CASES))
def test_fuzz(family, fuzz, calls):
    n, seed = fuzz
    run(family, CASES[family], n, seed, calls)
