"""LayerNorm / RMSNorm (+ residual) benchmark: ours (tk_cuda::layernorm) vs torch.compile default and
FLA's Triton layer norm, forward and backward, against the measured device-to-device copy ceiling, in one run.
The baselines' backward is their autograd from (y, h) into x, residual, w and b (one graph, kept between calls).

Shapes: rows 65536, hidden 1024/2048/4096/8192, bf16, `h = x + residual; y = LayerNorm(h)·w + b`
returning (y, h) (pre-norm residual block); RMSNorm at 4096; our backward (dy, dh -> dres, dw, db).
GB/s count minimal bytes: every input read once and every output written once
(forward: x, residual, y, h and w, b; backward: dy, dh, h, dres and w, dw, db). The forward is the inference
forward on both sides: torch.compile under no_grad, ours with stats=False (no mean/rstd, as the backend emits
it where no backward can run; the training forward also writes 8 bytes a row of statistics).
Every implementation's output is checked against the fp32 reference before it is timed.

    python -m benchmarks.layernorm [--quick]

Then the public API: the same norms written as models write them (`rms_norm(x + r) * w`, and a Llama block's norm
under autocast with an fp32 residual stream), compiled with backend="thunderkittens" beside default torch.compile,
forward and forward+backward: the kernel as Inductor's surrounding graph sees it.

Measured numbers, with their dates and commits: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from .common import Row, bandwidth_table, check_close, copy_ceiling_gbs, median_ms, progress

ROWS = 65536
HIDDEN = (1024, 2048, 4096, 8192)
EPS = 1e-5


def cases(quick: bool = False):
    """(rows, hidden, rms) per case."""
    sizes = (1024, 4096) if quick else HIDDEN
    for h in sizes:
        yield ROWS, h, False
    yield ROWS, 4096, True


def _eager(x, r, w, b, rms):
    h = x + r
    y = F.rms_norm(h, (h.shape[-1],), w, EPS) if rms else F.layer_norm(h, (h.shape[-1],), w, b, EPS)
    return y, h


def _fla():
    try:
        from fla.modules.norm.layernorm import layer_norm
    except ImportError:
        try:
            from fla.modules.layernorm import layer_norm
        except ImportError:
            return None
    return layer_norm


def _fwd_bytes(rows, hidden, rms):
    return (4 * rows * hidden + (1 if rms else 2) * hidden) * 2


# Every case compiles the same code (_eager's) again, once without and once with grad: past dynamo's default of 8
# recompiles the later cases ran torch.compile's baseline as eager (RMSNorm at 4096: 1.7 instead of ~3.3 TB/s
# backward, 2026-11-30).
@torch._dynamo.config.patch(recompile_limit=64)
def run(quick: bool = False) -> list[Row]:
    from tk_inductor import build
    from tk_inductor.ops import layernorm as ln_ops

    build.load("layernorm")
    fla_ln = _fla()
    rows_out: list[Row] = []
    ceiling = copy_ceiling_gbs()
    rows_out.append(Row("layernorm", "copy ceiling (2 GiB d2d)", "copy", 2 * 2**31 / ceiling / 1e6, ceiling, "GB/s"))
    for rows, hidden, rms in cases(quick):
        name = f"{rows}x{hidden} {'rms' if rms else 'ln'}+residual bf16"
        progress(name)
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)
        x, r, w = mk(rows, hidden), mk(rows, hidden), mk(hidden)
        b = None if rms else mk(hidden)
        ref_y, ref_h = _eager(x.float(), r.float(), w.float(), None if b is None else b.float(), rms)
        nbytes = _fwd_bytes(rows, hidden, rms)
        compiled = torch.compile(lambda *a: _eager(*a, rms), dynamic=False)
        impls = {
            # the inference forward, as the backend emits it under no_grad: no mean/rstd (stats=False)
            "ours": lambda: torch.ops.tk_cuda.layernorm(x, r, w, b, None, EPS, 0.0, rms, False)[:2],
            "torch.compile": lambda: compiled(x, r, w, b),
        }
        if fla_ln is not None:
            impls["fla"] = lambda: fla_ln(x, w, b, residual=r, eps=EPS, prenorm=True, is_rms_norm=rms)
        else:
            rows_out.append(Row("layernorm", f"{name} fwd", "fla", None, note="fla not installed"))
        with torch.no_grad():
            for impl, fn in impls.items():
                try:
                    y, h = fn()
                    check_close(f"{impl} {name} y", y, ref_y)
                    check_close(f"{impl} {name} h", h, ref_h)
                    ms = median_ms(fn)
                    rows_out.append(Row("layernorm", f"{name} fwd", impl, ms, nbytes / ms / 1e6, "GB/s", hidden))
                except (RuntimeError, AssertionError) as exc:
                    rows_out.append(Row("layernorm", f"{name} fwd", impl, None, note=f"failed: {str(exc)[:120]}"))
            # our backward: dy and dh (the residual stream's gradient) in, dres (= dx, no dropout), dw, db out
            y, h, mean, rstd, rng = torch.ops.tk_cuda.layernorm(x, r, w, b, None, EPS, 0.0, rms)
            dy, dh = mk(rows, hidden), mk(rows, hidden)
            bwd = lambda: torch.ops.tk_cuda.layernorm_backward(dy, dh, h, w, mean, rstd, rng, 0.0, rms, b is not None)
            ref = ln_ops.reference_backward(dy.float(), dh.float(), h.float(), w.float(), mean, rstd, rng, 0.0, rms, b is not None)
            bwd_bytes = (4 * rows * hidden + (2 if rms else 3) * hidden) * 2
            try:
                out = bwd()
                for got, want in zip(out, ref):
                    if want.numel():
                        check_close(f"ours {name} backward", got, want)
                ms = median_ms(bwd)
                rows_out.append(Row("layernorm", f"{name} bwd", "ours", ms, bwd_bytes / ms / 1e6, "GB/s", hidden))
            except (RuntimeError, AssertionError) as exc:
                rows_out.append(Row("layernorm", f"{name} bwd", "ours", None, note=f"failed: {str(exc)[:120]}"))
        # The baselines' backward: autograd of their (y, h) into x, residual, w (and b), the graph kept between
        # calls. x's and the residual's gradients are both dres (h = x + residual), checked against ours'.
        leaves = [t.detach().requires_grad_() for t in (x, r, w, b) if t is not None]
        baselines = {"torch.compile": lambda xl, rl, wl, *bl: compiled(xl, rl, wl, *(bl or (None,)))}
        if fla_ln is not None:
            baselines["fla"] = lambda xl, rl, wl, *bl: fla_ln(xl, wl, *(bl or (None,)), residual=rl, eps=EPS,
                                                              prenorm=True, is_rms_norm=rms)
        for impl, forward in baselines.items():
            try:
                yl, hl = forward(*leaves)
                step = lambda: torch.autograd.grad((yl, hl), leaves, (dy, dh), retain_graph=True)
                grads = step()
                check_close(f"{impl} {name} backward dx", grads[0], ref[0], tol=2e-2)
                ms = median_ms(step)
                rows_out.append(Row("layernorm", f"{name} bwd", impl, ms, bwd_bytes / ms / 1e6, "GB/s", hidden))
            except Exception as exc:  # a baseline that fails is a row, not the end of the run
                rows_out.append(Row("layernorm", f"{name} bwd", impl, None, note=f"failed: {str(exc)[:120]}"))
            finally:
                yl = hl = step = grads = None
        del x, r, w, b, ref_y, ref_h, leaves, ref
        torch.cuda.empty_cache()
    return rows_out + run_public(quick)


def _rms_times_w(x, r, w):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), eps=EPS) * w, h


def _ln_affine(x, r, w, b):
    h = x + r
    return F.layer_norm(h, (h.shape[-1],), w, b, EPS), h


def _llama_block_norm(x, r, w, eps=1e-6):
    """A Llama pre-norm step as written in models: the residual add, HF's RMSNorm (fp32 upcast, weight after the
    cast back), the normed rows cast to bf16 for the next matmul (autocast's cast, written out)."""
    h = r + x
    v = h.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return (w * v.to(h.dtype)).to(torch.bfloat16), h


def _mamba2_gated_norm(x, z, w, eps=1e-6):
    """Mamba-2's MambaRMSNormGated as HF writes it (one group), on the SSD's fp32 output and the bf16 gate, the
    result cast to bf16 for the out projection (HF's `out_proj(scan_output.to(dtype))`). A 1-tuple, as the other
    cases return tuples."""
    h = x.to(torch.float32) * F.silu(z.to(torch.float32))
    hg = h.view(*h.shape[:-1], 1, h.shape[-1])
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    return ((w * hg.view(h.shape).to(x.dtype)).to(torch.bfloat16),)


def public_cases(quick: bool = False):
    """(name, function, inputs, output grads, forward bytes, step bytes, hidden): the issue's public-API forms."""
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s, dtype=torch.bfloat16: torch.randn(*s, generator=g, device="cuda", dtype=dtype)
    sizes = ((1024, "rms"), (2048, "ln")) if quick else ((1024, "rms"), (4096, "rms"), (1024, "ln"), (2048, "ln"))
    for hidden, kind in sizes:
        x, r = mk(ROWS, hidden).requires_grad_(), mk(ROWS, hidden).requires_grad_()
        w = mk(hidden).requires_grad_()
        b = mk(hidden).requires_grad_() if kind == "ln" else None
        fn, inputs = (_rms_times_w, (x, r, w)) if kind == "rms" else (_ln_affine, (x, r, w, b))
        grads = (mk(ROWS, hidden), mk(ROWS, hidden))
        n = ROWS * hidden
        # forward: x, r read, y, h written; step: the forward, then dy, dh, h read and dx/dres written
        yield f"{ROWS}x{hidden} {kind}+residual bf16", fn, inputs, grads, 4 * n * 2, 8 * n * 2, hidden
    # autocast with fp32 parameters: an fp32 residual stream, a bf16 branch output, an fp32 weight, the output in bf16
    for hidden in ((2048,) if quick else (2048, 4096)):
        x = mk(ROWS, hidden).requires_grad_()
        r = mk(ROWS, hidden, dtype=torch.float32).requires_grad_()
        w = mk(hidden, dtype=torch.float32).requires_grad_()
        grads = (mk(ROWS, hidden), mk(ROWS, hidden, dtype=torch.float32))
        n = ROWS * hidden
        # forward: x (2) + r (4) read, y (2) + h (4) written; step: + dy (2), dh (4), h (4) read, dres (4), dx (2)
        yield f"{ROWS}x{hidden} rms autocast (bf16 x, fp32 residual/w)", _llama_block_norm, (x, r, w), grads, 12 * n, 28 * n, hidden
    # Mamba-2's gated norm in a bf16 model: fp32 x (the SSD's output), bf16 gate and weight, bf16 output
    for hidden in ((2048,) if quick else (2048, 5120)):
        x = mk(ROWS, hidden, dtype=torch.float32).requires_grad_()
        z, w = mk(ROWS, hidden).requires_grad_(), mk(hidden).requires_grad_()
        n = ROWS * hidden
        # forward: x (4) + z (2) read, y (2) written; step: + dy (2), x (4), z (2) read, dx (4), dz (2) written
        yield f"{ROWS}x{hidden} gated rms (fp32 x, bf16 gate/w)", _mamba2_gated_norm, (x, z, w), (mk(ROWS, hidden),), 8 * n, 22 * n, hidden


def run_public(quick: bool = False) -> list[Row]:
    from .common import public_api_rows, warm_up

    warm_up()
    rows = []
    for name, fn, inputs, grads, fwd_bytes, step_bytes, hidden in public_cases(quick):
        progress(f"{name} public")
        rows += public_api_rows("layernorm", name, fn, inputs, grads, fwd_bytes, step_bytes, hidden)
    return rows


def summary(rows: list[Row]) -> str:
    return bandwidth_table(rows, ["torch.compile", "fla"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layernorm", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="hidden 1024 and 4096 only")
    args = p.parse_args(argv)
    print(summary(run(quick=args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
