"""Linear-attention benchmark: ours (tk_cuda::linear_attention, Based) vs flash-linear-attention's Triton
`parallel_based` and `fused_chunk_based` (carry the fla-core wheel) and vs torch.compile default of the quadratic
masked spelling a Based model writes (what Inductor gets without our kernel), in one run. Then the plain feature map
elu + 1 (normalised, dk 64 and 128) vs FLA's `chunk_linear_attn` and `fused_chunk_linear_attn` on the mapped q and
k (the map in PyTorch, as FLA's LinearAttention layer applies it) and vs torch.compile of the quadratic form; and
the Hedgehog paper's map (per-head W, 64 projections: 128 features; normalised, scale 1) likewise. Then simple GLA
(tk::simple_gla, the SSD kernels without A) vs FLA's `chunk_simple_gla` and torch.compile of its chunked reference.

Shapes: 65536 tokens (B·N), H16, feature dim 16, dv 64 (the Based model's) at N 1024, 4096, 16384, plus dv 128
at N 4096, and the Based model's own layer (B4 H16 N4096 dv64); bf16 (B, N, H, d) buffers (FLA's layout; ours
reads their head-first views in place); normalised, scale d^-½, eps 1e-6 (FLA's).

Forward+backward at 65536 tokens and at the model's layer:
- "ours": the op's autograd, the forward and backward kernels (kernel B picking its tile by block count);
- "ours (kernel fwd, reference bwd)": the same with the backward kernel off: the reference's autograd as the
  backward.
The torch.compile baseline gets the work-arounds our backend applies to Inductor (torch 2.11's CantSplit fix).
Figure: Mtokens/s.

    python -m benchmarks.linear_attention [--quick]
"""
from __future__ import annotations

import math

import torch

from .common import (Row, backward_step, check_and_time, inductor_as_our_backend_runs_it, op_main, progress, with_attr)

DK = 16


def cases(quick: bool = False):
    """(B, H, N, dv) per case."""
    yield 16, 16, 4096, 64
    if not quick:
        yield 4, 16, 4096, 64  # the Based model's layer (64 blocks of 64 value columns: half the SMs)
        yield 64, 16, 1024, 64
        yield 4, 16, 16384, 64
        yield 16, 16, 4096, 128


TRAIN_CASES = ((4, 16, 4096, 64), (16, 16, 4096, 64))  # forward+backward: the model's layer, 65536 tokens


def taylor(x: torch.Tensor) -> torch.Tensor:
    """The Based model's feature map (tk_inductor/models/based.py): φ(q)·φ(k) = 1 + s + s²/2, s = q·k/√d."""
    d = x.shape[-1]
    x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2)
    return torch.cat([torch.ones_like(x[..., :1]), x / d**0.25, x2 / math.sqrt(d)], dim=-1)


def quadratic(q, k, v, eps: float = 1e-6):
    """The masked quadratic form a research model writes (head-first inputs)."""
    fq, fk = taylor(q), taylor(k)
    scores = (fq @ fk.transpose(-1, -2)).tril()
    return (scores @ v) / (scores.sum(-1, keepdim=True) + eps)


PLAIN_CASES = ((16, 16, 4096, 64, 64), (4, 16, 4096, 64, 64), (16, 16, 4096, 128, 128))
# Hedgehog: (B, H, N, dk, dv, f), the paper's map with f = 64 projections per head (128 features)
HEDGEHOG_CASES = ((16, 16, 4096, 64, 64, 64), (4, 16, 4096, 64, 64, 64), (16, 16, 4096, 128, 128, 64))


def elu1(x):
    return torch.nn.functional.elu(x) + 1


def hedgehog(x, w):
    """The Hedgehog paper's map on (B, N, H, d) x and per-head W (H, d, f): cat(softmax(x W), softmax(-x W))."""
    z = torch.einsum("bnhd,hdf->bnhf", x, w)
    return torch.cat([z.softmax(-1), (-z).softmax(-1)], -1)


def mapped(x, w):
    """elu + 1 (no weights) or Hedgehog's map."""
    return elu1(x) if w is None else hedgehog(x, w)


def mapped_quadratic(fq, fk, v, scale, eps: float = 1e-6):
    """The masked quadratic form of normalised linear attention on mapped (B, N, H, F) features, head-first out."""
    fq, fk, v = (t.transpose(1, 2) for t in (fq, fk, v))
    scores = (fq @ fk.transpose(-1, -2) * scale).tril()
    return (scores @ v) / (scores.sum(-1, keepdim=True) + eps)


def _rows(name, impls, ref, B, N, leaves=None, grad_out=None, tol=2e-2) -> list[Row]:
    """One case's rows in Mtokens/s: the forwards checked against `ref`, or with grad_out the forward+backward steps,
    checked by the first leaf's gradient against `ref` (the reference's)."""
    if grad_out is not None:
        impls = {label: backward_step(fn, leaves, grad_out, of=leaves[0]) for label, fn in impls.items()}
    return check_and_time("linear_attention", name, impls, ref, N, "Mtok/s", lambda ms: B * N / ms / 1e3, tol=tol)


def run_plain(quick: bool = False, cases=None, fla_kernels=("chunk", "fused_chunk"), feature_map: str = "elu1"
              ) -> list[Row]:
    """Normalised elu + 1 (cases (B, H, N, dk, dv), scale dk^-½) or Hedgehog (cases (B, H, N, dk, dv, f), scale 1,
    per-head bf16 weights): forward, then forward+backward, per case, against the FLA kernels named
    (`chunk_linear_attn`, `fused_chunk_linear_attn`) on the features mapped in PyTorch (their time counted) and
    torch.compile of the quadratic form."""
    from tk_inductor.ops import linear_attention as la

    try:
        from fla.ops.linear_attn import chunk_linear_attn, fused_chunk_linear_attn
    except ImportError as exc:
        fla, fla_missing = None, f"fla not installed ({exc.name})"
    else:
        fla = {f"fla {name}_linear_attn": fn for name, fn in
               (("chunk", chunk_linear_attn), ("fused_chunk", fused_chunk_linear_attn)) if name in fla_kernels}
    inductor_as_our_backend_runs_it()
    compiled = torch.compile(lambda q, k, v, wq, wk, scale: mapped_quadratic(mapped(q, wq), mapped(k, wk), v, scale),
                             dynamic=False)
    cases = cases or (HEDGEHOG_CASES if feature_map == "hedgehog" else PLAIN_CASES)
    rows: list[Row] = []
    for case in cases[:1] if quick else cases:
        B, H, N, dk, dv = case[:5]
        f = case[5] if feature_map == "hedgehog" else None
        scale = 1.0 if f else dk**-0.5
        for train in (False, True):
            name = f"B{B} H{H} N{N} d{dk} dv{dv} {feature_map}{f or ''} {'fwd+bwd' if train else 'fwd'}"
            progress(name)
            g = torch.Generator(device="cuda").manual_seed(0)
            leaves = [torch.randn(B, N, H, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(train)
                      for d in (dk, dk, dv)]
            weights = [] if f is None else [
                (torch.randn(H, dk, f, generator=g, device="cuda") / dk**0.5).bfloat16().requires_grad_(train)
                for _ in range(2)]
            q, k, v = leaves
            wq, wk = weights or (None, None)
            leaves += weights

            def heads(t):
                return t.transpose(1, 2)

            want = [t.detach().float().requires_grad_(train) for t in leaves]
            ref = la.linear_attention_reference(*(heads(t) for t in want[:3]), feature_map, *(want[3:] or (None, None)),
                                                scale, True, 1e-6)
            impls = {"ours": lambda: torch.ops.tk.linear_attention(heads(q), heads(k), heads(v), feature_map, wq, wk,
                                                                   scale, True, 1e-6)}
            if fla is not None:
                for label, fn in fla.items():
                    impls[label] = (lambda fn=fn: heads(fn(mapped(q, wq), mapped(k, wk), v, scale, normalize=True)[0]))
            if not train and B * H * N * N * 4 <= 8 * 2**30:  # its N² scores, and their gradients in training
                impls["torch.compile"] = lambda: compiled(q, k, v, wq, wk, scale)
            else:
                rows.append(Row("linear_attention", name, "torch.compile", None,
                                note="skipped: N² scores (and in training their gradients) too large"))
            if train:
                do = torch.randn(B, H, N, dv, device="cuda", dtype=torch.bfloat16)
                ref.backward(do.float())
                rows += _rows(name, impls, want[0].grad, B, N, leaves, do)
            else:
                rows += _rows(name, impls, ref.detach().float(), B, N, tol=1e-2)
            if fla is None:
                rows.append(Row("linear_attention", name, "fla", None, note=fla_missing))
            del leaves, q, k, v, want, ref, weights
            torch.cuda.empty_cache()
    return rows


# the last: key dim 256 as FLA's layers use it, which the op runs as two blocks of 128 (ops/_state_parts.py)
SIMPLE_GLA_CASES = ((8, 16, 4096, 128, 128), (2, 16, 16384, 128, 128), (16, 16, 4096, 64, 64), (8, 8, 4096, 256, 256))


def run_simple_gla(quick: bool = False, cases=None, fla_kernels=("chunk", "parallel", "fused_chunk")) -> list[Row]:
    """Simple GLA (cases (B, H, N, dk, dv); scale dk^-½, log decays logsigmoid(randn + 2) in fp32): forward, then
    forward+backward, per case, against the FLA kernels named (`chunk_simple_gla`, `parallel_simple_gla`,
    `fused_chunk_simple_gla`) and torch.compile of the chunked fp32 reference."""
    from tk_inductor.ops import simple_gla as sg

    try:
        import fla.ops.simple_gla as fla_sg
    except ImportError as exc:
        fla, fla_missing = None, f"fla not installed ({exc.name})"
    else:
        fla = {f"fla {name}_simple_gla": getattr(fla_sg, f"{name}_simple_gla") for name in fla_kernels}
    inductor_as_our_backend_runs_it()
    compiled = torch.compile(sg.simple_gla_reference, dynamic=False)
    rows: list[Row] = []
    cases = cases or SIMPLE_GLA_CASES
    for B, H, N, dk, dv in cases[:1] if quick else cases:
        scale = dk**-0.5
        for train in (False, True):
            name = f"B{B} H{H} N{N} d{dk} dv{dv} simple_gla {'fwd+bwd' if train else 'fwd'}"
            progress(name)
            g = torch.Generator(device="cuda").manual_seed(0)
            leaves = [torch.randn(B, N, H, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(train)
                      for d in (dk, dk, dv)]
            leaves.append(torch.nn.functional.logsigmoid(torch.randn(B, N, H, generator=g, device="cuda") + 2)
                          .requires_grad_(train))
            q, k, v, gate = leaves
            want = [t.detach().float().requires_grad_(train) for t in leaves]
            ref = sg.simple_gla_reference(*want, scale)[0]
            impls = {"ours": lambda: torch.ops.tk.simple_gla(q, k, v, gate, scale)[0]}
            for label, fn in (fla or {}).items():
                impls[label] = lambda fn=fn: fn(q, k, v, g=gate, scale=scale)[0]
            if not train:
                impls["torch.compile"] = lambda: compiled(q, k, v, gate, scale)[0]
            if train:
                do = torch.randn(B, N, H, dv, device="cuda", dtype=torch.bfloat16)
                ref.backward(do.float())
                rows += _rows(name, impls, want[0].grad, B, N, leaves, do)
            else:
                rows += _rows(name, impls, ref.detach().float(), B, N)
            if fla is None:
                rows.append(Row("linear_attention", name, "fla", None, note=fla_missing))
            del leaves, q, k, v, gate, want, ref
            torch.cuda.empty_cache()
    return rows


def hedgehog_layer(q, k, v, wq, wk, bq=None, bk=None):
    """A Hedgehog layer's attention as a research model writes it (heads-first, the masked quadratic form,
    normalised): the paper's map cat(softmax(x W), softmax(-x W)) with per-head W, or, given biases, FLA's and the
    paper code's softmax(cat(2 (x Wᵀ + b), -2 (x Wᵀ + b))) with nn.Linear's shared (f, d) weight."""
    def phi(x, w, b):
        if b is None:
            z = torch.einsum("bhnd,hdf->bhnf", x, w)
            return torch.cat([z.softmax(-1), (-z).softmax(-1)], -1)
        y = 2 * torch.nn.functional.linear(x, w, b)
        return torch.cat([y, -y], -1).softmax(-1)

    scores = (phi(q, wq, bq) @ phi(k, wk, bk).transpose(-1, -2)).tril()
    return (scores @ v) / (scores.sum(-1, keepdim=True) + 1e-6)


def run_public(quick: bool = False, B: int = 4, H: int = 16, N: int = 4096, d: int = 64) -> list[Row]:
    """Hedgehog layers (hedgehog_layer, both spellings; bf16, weights trained) compiled through the public API,
    backend="thunderkittens" beside torch.compile default: forward and a forward+backward step."""
    from .common import public_api_rows

    rows: list[Row] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(B, H, N, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    grads = (torch.randn(B, H, N, d, generator=g, device="cuda", dtype=torch.bfloat16),)
    for spelling in ("hedgehog", "fla_hedgehog")[:1 if quick else 2]:
        progress(f"B{B} H{H} N{N} d{d} {spelling} public")
        shape = (H, d, d) if spelling == "hedgehog" else (d, d)
        ws = [(torch.randn(*shape, generator=g, device="cuda") / d**0.5).bfloat16().requires_grad_() for _ in range(2)]
        bs = [torch.zeros(d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2)] \
            if spelling == "fla_hedgehog" else []
        io = 4 * B * H * N * d * 2  # q, k, v and o in bf16
        rows += public_api_rows("linear_attention", f"B{B} H{H} N{N} d{d} {spelling}", hedgehog_layer,
                                (*qkv, *ws, *bs), grads, io, 2 * io, N)
    return rows


def run(quick: bool = False) -> list[Row]:
    from tk_inductor import build
    from tk_inductor.ops import linear_attention as la

    build.load("linear_attention")
    try:
        from fla.ops.based import fused_chunk_based, parallel_based
    except ImportError as exc:
        fla = None
        fla_missing = f"fla not installed ({exc.name})"
    else:
        fla = {"fla parallel_based": parallel_based, "fla fused_chunk_based": fused_chunk_based}
    rows: list[Row] = []
    scale = DK**-0.5
    inductor_as_our_backend_runs_it()
    compiled = torch.compile(quadratic, dynamic=False)
    for B, H, N, dv in cases(quick):
        name = f"B{B} H{H} N{N} d{DK} dv{dv} based fwd"
        progress(name)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(B, N, H, DK, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(B, N, H, dv, generator=g, device="cuda", dtype=torch.bfloat16)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        ref = la.linear_attention_reference(qh, kh, vh, "based", None, None, scale, True, 1e-6).float()
        def ours():
            return torch.ops.tk_cuda.linear_attention(qh, kh, vh, "based", None, None, scale, True, 1e-6)

        impls = {"ours": ours}
        if fla is not None:
            for label, fn in fla.items():
                impls[label] = (lambda f=fn: f(q, k, v, scale, True).transpose(1, 2))
        # the quadratic form materialises B·H·N² scores: only where that fits comfortably
        if B * H * N * N * 4 <= 16 * 2**30:
            impls["torch.compile"] = lambda: compiled(qh, kh, vh)
        else:
            rows.append(Row("linear_attention", name, "torch.compile", None, note="skipped: N² scores > 16 GiB"))
        rows += check_and_time("linear_attention", name, impls, ref, N, "Mtok/s", lambda ms: B * N / ms / 1e3)
        if fla is None:
            rows.append(Row("linear_attention", name, "fla", None, note=fla_missing))
        del q, k, v, ref
        torch.cuda.empty_cache()
    for B, H, N, dv in TRAIN_CASES[:1] if quick else TRAIN_CASES:
        name = f"B{B} H{H} N{N} d{DK} dv{dv} based fwd+bwd"
        progress(name)
        g = torch.Generator(device="cuda").manual_seed(0)
        leaves = [torch.randn(B, N, H, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
                  for d in (DK, DK, dv)]
        q, k, v = leaves
        do = torch.randn(B, H, N, dv, device="cuda", dtype=torch.bfloat16)
        want = [t.detach().float().requires_grad_() for t in leaves]
        la.linear_attention_reference(*(t.transpose(1, 2) for t in want), "based", None, None, scale, True,
                                      1e-6).backward(do.float())

        def heads(t):
            return t.transpose(1, 2)

        def ours():
            return torch.ops.tk.linear_attention(heads(q), heads(k), heads(v), "based", None, None, scale, True, 1e-6)

        impls = {"ours": ours,
                 "torch.compile": lambda: compiled(heads(q), heads(k), heads(v))}
        if fla is not None:
            for label, fn in fla.items():
                impls[label] = (lambda f=fn: heads(f(q, k, v, scale, True)))
        steps = {label: backward_step(fn, leaves, do, of=q) for label, fn in impls.items()}
        # the flag is read when the backward runs: set around the whole step
        steps["ours (kernel fwd, reference bwd)"] = lambda: with_attr(la, "BACKWARD_KERNEL_VALIDATED", False,
                                                                      steps["ours"])
        rows += check_and_time("linear_attention", name, steps, want[0].grad, N, "Mtok/s",
                               lambda ms: B * N / ms / 1e3, tol=2e-2)
        del leaves, q, k, v, want
        torch.cuda.empty_cache()
    return (rows + run_plain(quick) + run_plain(quick, feature_map="hedgehog") + run_simple_gla(quick)
            + run_public(quick))


def main(argv=None) -> int:
    return op_main("python -m benchmarks.linear_attention", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
