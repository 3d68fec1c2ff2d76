"""One forward and one backward of ours and of cuDNN SDPA, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        python -m benchmarks.tuning.profile_attention [--n 4096 --d 128 --causal]

Only the calls between cudaProfilerStart/Stop are profiled (inputs are made and the kernels built before).
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--no-backward", action="store_true")
    args = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tk_inductor import build

    build.load("attention")
    N, D = args.n, args.d
    B, H = 65536 // N, 2048 // D
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1.0 / math.sqrt(D)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qg, kg, vg, is_causal=args.causal, scale=scale)

    for _ in range(2):  # warm-up: cuDNN plans, our first launch
        o, lse = torch.ops.tk_cuda.attention(q, k, v, args.causal, scale)
        if not args.no_backward:
            torch.ops.tk_cuda.attention_backward(do, q, k, v, o, lse, args.causal, scale)
            cudnn().backward(do)
        else:
            cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    o, lse = torch.ops.tk_cuda.attention(q, k, v, args.causal, scale)
    if not args.no_backward:
        torch.ops.tk_cuda.attention_backward(do, q, k, v, o, lse, args.causal, scale)
    out = cudnn()
    if not args.no_backward:
        out.backward(do)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
