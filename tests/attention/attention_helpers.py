"""Shared pieces of the attention tests: inputs, small modules and the compile/check helpers."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor

OPTS = {"reference": True, "inner": "aot_eager"}


def _qkv(B, Hq, Hkv, N, M, D, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, M, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, M, D, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _compile(model, options=None):
    tk_inductor.reset()
    torch._dynamo.reset()
    return torch.compile(model, backend="thunderkittens", options=options or OPTS)


def _kept(model, *inputs, options=None):
    """Compile and return the attention kept reasons (output still equals eager)."""
    out = _compile(model, options)(*inputs)
    report = tk_inductor.report()
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
    assert report.replaced.get("attention", 0) == 0, str(report)
    reasons = [r for f, r in report.kept if f == "attention"]
    assert reasons, str(report)
    return reasons


def _inputs(B=2, Hq=4, Hkv=4, N=8, M=8, D=16, seed=0):
    return _qkv(B, Hq, Hkv, N, M, D, dtype=torch.float32, seed=seed)


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def repeat_kv(x, n_rep):  # HF's spelling
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _eager(product="matmul", scale="mul_scores", mask="masked_fill_tril", softmax="f", gqa=1, dropout=None):
    """Build an eager attention function from interchangeable spellings."""

    def fn(q, k, v):
        B, H, N, D = q.shape
        M = k.shape[-2]
        k, v = repeat_kv(k, gqa), repeat_kv(v, gqa)
        if scale == "q_mul":
            q = q * D ** -0.5
        if product == "matmul":
            s = torch.matmul(q, k.transpose(2, 3))
        elif product == "at":
            s = q @ k.transpose(-2, -1)
        elif product == "mT":
            s = q @ k.mT
        elif product == "permute":
            s = q.matmul(k.permute(0, 1, 3, 2))
        elif product == "bmm":
            s = torch.bmm(q.reshape(B * H, N, D), k.reshape(B * H, M, D).transpose(1, 2)).view(B, H, N, M)
        elif product == "einsum":
            s = torch.einsum("bhnd,bhmd->bhnm", q, k)
        if scale == "mul_scores":
            s = s * D ** -0.5
        elif scale == "div_scores":
            s = s / math.sqrt(D)
        allowed = torch.ones(N, M, dtype=torch.bool, device=q.device).tril()
        if mask == "masked_fill_tril":
            s = s.masked_fill(~allowed, float("-inf"))
        elif mask == "masked_fill_triu_finfo":
            s = s.masked_fill(torch.triu(torch.ones(N, M, device=q.device), diagonal=1).bool(),
                              torch.finfo(s.dtype).min)
        elif mask == "ones_tril_eq0":
            s = s.masked_fill(torch.tril(torch.ones(N, M, device=q.device)) == 0, float("-inf"))
        elif mask == "where_arange":
            rows = torch.arange(N, device=q.device)[:, None]
            cols = torch.arange(M, device=q.device)[None, :]
            s = torch.where(cols <= rows, s, torch.tensor(float("-inf"), device=q.device))
        elif mask == "where_arange_gt":
            i = torch.arange(N, device=q.device).view(1, 1, N, 1)
            j = torch.arange(M, device=q.device).view(1, 1, 1, M)
            s = torch.where(j > i, torch.finfo(s.dtype).min, s)
        elif mask == "additive_triu":
            s = s + torch.full((N, M), float("-inf"), device=q.device).triu(1)
        elif mask == "additive_where":
            s = s + torch.where(allowed, 0.0, torch.finfo(s.dtype).min)[None, None]
        elif mask == "all_visible":  # a provably empty mask: the attention is not causal
            s = s.masked_fill(torch.zeros(N, M, dtype=torch.bool, device=q.device), float("-inf"))
            s = s + torch.zeros(N, M, device=q.device)
        elif mask == "twice":  # the same causal mask applied twice is still causal
            s = s.masked_fill(~allowed, float("-inf")) + torch.where(allowed, 0.0, float("-inf"))
        elif mask == "none":
            pass
        if scale == "div_after_mask":
            s = s / math.sqrt(D)
        if softmax == "f":
            p = F.softmax(s, dim=-1)
        elif softmax == "f_fp32":
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        elif softmax == "torch":
            p = torch.softmax(s, -1)
        elif softmax == "method_upcast":
            p = s.float().softmax(dim=-1).type_as(q)
        if dropout is not None:
            p = F.dropout(p, p=dropout[0], training=dropout[1])
        if product == "bmm":
            return torch.bmm(p.view(B * H, N, M), v.reshape(B * H, M, D)).view(B, H, N, D)
        if product == "einsum":
            return torch.einsum("bhnm,bhmd->bhnd", p, v)
        return torch.matmul(p, v)

    return fn


def _kernel_built() -> bool:
    """False where the kernels cannot run (no sm_90 GPU: the caller skips). On an sm_90 GPU the kernels must load:
    a failed build fails the test with the compiler's error instead of skipping it."""
    from tk_inductor import build

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return False
    build.load("attention")
    return True


def _check(model, *inputs, replaced=1, grad=True, tol=1e-5, kept=0):
    """Compiled (reference mode) == eager, forward and gradients; the report says what was replaced."""
    inputs = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]
    ref_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = _compile(model)(*inputs)
    report = tk_inductor.report()
    ref = model(*ref_inputs)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert report.replaced.get("attention", 0) == replaced, str(report)
    assert len([r for f, r in report.kept if f == "attention"]) == kept, str(report)
    if grad:
        w = torch.randn_like(ref)
        params = [p for p in model.parameters() if p.requires_grad]
        got = torch.autograd.grad((out * w).sum(), [x for x in inputs if x.requires_grad] + params)
        model.zero_grad(set_to_none=True)
        want = torch.autograd.grad((ref * w).sum(), [x for x in ref_inputs if x.requires_grad] + params)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return report


def stand_in_kernels(monkeypatch, seen_grad_lse: list | None = None):
    """The raw CUDA kernels stood in for by the fp32 reference with their conventions (interval tables as masks,
    rows without keys: o = 0, lse = +inf, no gradient), so that the ops' kernel paths run on a CPU. seen_grad_lse
    collects the backward's grad_lse arguments."""
    from tk_inductor.ops import _dispatch
    from tk_inductor.ops import attention as A

    def dense(table, n, m, by_rows):  # an interval table as a (B, 1, n, m) bool mask
        x, y = table[..., 0], table[..., 1]
        idx = torch.arange(m if by_rows else n)
        inside = (idx >= x[..., None]) & (idx <= y[..., None])
        return (inside if by_rows else inside.transpose(-1, -2))[:, None]

    class Raw:
        def attention(self, q, k, v, causal, scale, window=0, softcap=0.0, dropout_p=0.0, rng=None, row_keys=None):
            mask = None if row_keys is None else dense(row_keys, q.shape[2], k.shape[2], True)
            return A.attention_reference(q, k, v, causal, scale, window, softcap, mask, dropout_p, rng)

        def attention_backward(self, grad_o, q, k, v, o, lse, causal, scale, window=0, softcap=0.0, dropout_p=0.0,
                               rng=None, grad_lse=None, key_rows=None):
            if seen_grad_lse is not None:
                seen_grad_lse.append(grad_lse)
            mask = None if key_rows is None else dense(key_rows, q.shape[2], k.shape[2], False)
            return A.attention_backward_reference(grad_o, q, k, v, o, lse, causal, scale, mask, window, softcap,
                                                  dropout_p, rng, grad_lse=grad_lse)

    monkeypatch.setattr(_dispatch, "use_kernel", lambda family, *tensors: True)
    monkeypatch.setattr(_dispatch, "kernel", lambda name: getattr(Raw(), name))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no CUDA here
