"""Rotary benchmark: ours (tk_cuda::rotary, q and k in one launch) vs HF's apply_rotary_pos_emb under
torch.compile default and eager, against the measured device-to-device copy ceiling, in one run.

Shapes: B16 H16 N4096, D 128 and 64, bf16, q/k (B, H, N, D), cos/sin (B, N, D) unsqueezed at dim 1
(HF Llama), full and NeoX-style partial (rotary_dim = D/4) rotation, forward and our backward.
GB/s count minimal bytes: q, k read once, outputs written once, cos and sin read once.

    python -m benchmarks.rotary [--quick]

Measured 2026-11-29, one H200 (torch 2.11), copy ceiling 4273 GB/s:
    case (bf16)                          ours GB/s (% copy)  torch.compile  eager  ours/compile
    B16 H16 N4096 D128 fwd               3811 (89%)          3985           349    0.96
    B16 H16 N4096 D64  fwd               3709 (87%)          3898           343    0.95
    B16 H16 N4096 D128 rotary_dim 32 fwd 2886 (68%)          3498           488    0.83
    backward (same kernel, transposed rotation): 3803 / 3738 / 2887 GB/s.
"""
from __future__ import annotations

import argparse

import torch

from .common import Row, bandwidth_table, check_close, copy_ceiling_gbs, median_ms, progress


def cases(quick: bool = False):
    """(B, H, N, D, rotary_dim) per case."""
    yield 16, 16, 4096, 128, 128
    yield 16, 16, 4096, 64, 64
    if not quick:
        yield 16, 16, 4096, 128, 32


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """HF transformers (Llama / GPT-NeoX partial) spelling."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rd = cos.shape[-1]
    if rd == q.shape[-1]:
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
    q_rot, q_pass = q[..., :rd], q[..., rd:]
    k_rot, k_pass = k[..., :rd], k[..., rd:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def run(quick: bool = False) -> list[Row]:
    from tk_inductor import build

    build.load("rotary")
    out_rows: list[Row] = []
    ceiling = copy_ceiling_gbs()
    out_rows.append(Row("rotary", "copy ceiling (2 GiB d2d)", "copy", 2 * 2**31 / ceiling / 1e6, ceiling, "GB/s"))
    for B, H, N, D, rd in cases(quick):
        name = f"B{B} H{H} N{N} D{D}" + (f" rotary_dim {rd}" if rd < D else "")
        progress(name)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
        ang = torch.rand(B, N, rd // 2, generator=g, device="cuda") * 6.3
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)
        nbytes = (4 * B * H * N * D + 2 * B * N * rd) * 2
        ref = apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
        impls = {
            "ours": lambda: torch.ops.tk_cuda.rotary(q, k, c4, s4, False, False, False),
            "torch.compile": (lambda f=torch.compile(apply_rotary_pos_emb, dynamic=False): f(q, k, cos, sin)),
            "eager": lambda: apply_rotary_pos_emb(q, k, cos, sin),
        }
        for impl, fn in impls.items():
            try:
                qo, ko = fn()
                check_close(f"{impl} {name} q", qo, ref[0])
                check_close(f"{impl} {name} k", ko, ref[1])
                ms = median_ms(fn)
                out_rows.append(Row("rotary", f"{name} fwd", impl, ms, nbytes / ms / 1e6, "GB/s", D))
            except (RuntimeError, AssertionError) as exc:
                out_rows.append(Row("rotary", f"{name} fwd", impl, None, note=f"failed: {str(exc)[:120]}"))
        # backward (the transposed rotation, same kernel) on incoming gradients
        try:
            from tk_inductor.ops import rotary as rot_ops

            bwd = lambda: torch.ops.tk_cuda.rotary(q, k, c4, s4, False, True, False)
            got = bwd()
            want = rot_ops.reference(q.float(), k.float(), c4.float(), s4.float(), False, True, False)
            check_close(f"ours {name} bwd", got[0], want[0])
            ms = median_ms(bwd)
            out_rows.append(Row("rotary", f"{name} bwd", "ours", ms, nbytes / ms / 1e6, "GB/s", D))
        except (RuntimeError, AssertionError) as exc:
            out_rows.append(Row("rotary", f"{name} bwd", "ours", None, note=f"failed: {str(exc)[:120]}"))
        del q, k, ref
        torch.cuda.empty_cache()
    return out_rows + run_public(quick)


def _autocast_rope(q, k, cos, sin):
    """HF's apply_rotary_pos_emb under autocast with fp32 tables (fp32 results), cast to bf16 for SDPA."""
    q2, k2 = apply_rotary_pos_emb(q, k, cos, sin)
    return q2.to(torch.bfloat16), k2.to(torch.bfloat16)


def run_public(quick: bool = False) -> list[Row]:
    """The public API: HF's spelling compiled with backend="thunderkittens" beside default torch.compile, with bf16
    tables (pure bf16) and with fp32 tables on bf16 q/k (autocast with fp32 parameters), forward and
    forward+backward."""
    from .common import public_api_rows, warm_up

    warm_up()
    rows = []
    for B, H, N, D, rd in ((16, 16, 4096, 128, 128),) if quick else ((16, 16, 4096, 128, 128), (16, 16, 4096, 64, 64)):
        for tables in (torch.bfloat16, torch.float32):
            name = f"B{B} H{H} N{N} D{D} {'bf16' if tables == torch.bfloat16 else 'fp32'} tables"
            progress(f"{name} public")
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
            k = torch.randn(B, H, N, D, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
            ang = torch.rand(B, N, rd // 2, generator=g, device="cuda") * 6.3
            ang = torch.cat((ang, ang), -1)
            cos, sin = ang.cos().to(tables), ang.sin().to(tables)
            fn = apply_rotary_pos_emb if tables == torch.bfloat16 else _autocast_rope
            grads = tuple(torch.randn_like(t) for t in (q, k))
            n = B * H * N * D
            cs = 2 * B * N * rd * cos.element_size()
            # forward: q, k read and written once, the tables once; step: + the gradients read and written
            rows += public_api_rows("rotary", name, fn, (q, k, cos, sin), grads, 4 * n * 2 + cs, 8 * n * 2 + 2 * cs, D)
            del q, k
            torch.cuda.empty_cache()
    return rows


def summary(rows: list[Row]) -> str:
    return bandwidth_table(rows, ["torch.compile", "eager"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rotary", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="full rotation only")
    args = p.parse_args(argv)
    print(summary(run(quick=args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
