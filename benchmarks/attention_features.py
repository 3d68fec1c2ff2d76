"""Attention benchmarks of the features the models beyond Llama bring: multi-head latent attention's two head dims
(DeepSeek), attention sinks (gpt-oss) and two-sided windows (encoders: ModernBERT), each against the fastest
alternative a user has. Run through `python -m benchmarks.attention --mla` or `--sinks-bands`."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .attention import _checked_fwd_bwd, _sdpa, _visible
from .common import Row, progress


MLA_CASES = [(65536 // N, 16, N, 192, 128, causal) for N in (2048, 8192) for causal in (True, False)]


def run_mla(backward: bool = True) -> list[Row]:
    """Multi-head latent attention's head dims (DeepSeek-V2/V3, Kimi-K2: q/k 192, v 128), bf16, 65536 tokens: ours
    through tk::attention (the kernels on q/k and v zero-padded to 192, the output sliced) against each SDPA backend
    that takes two head dims, forward and forward+backward (TFLOPS of the unpadded math)."""
    from torch.nn.attention import SDPBackend

    import tk_inductor.ops.attention  # noqa: F401  (registers tk::attention)
    from tk_inductor import build

    build.load("attention")
    baselines = {n: _sdpa(b) for n, b in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                                          ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
    rows: list[Row] = []
    for B, H, N, D, Dv, causal in MLA_CASES:
        name = f"B{B} H{H} N{N} D{D}/{Dv} {'causal' if causal else 'full'}"
        progress(name)
        scale = 1.0 / math.sqrt(D)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        v, do = (torch.randn(B, H, N, Dv, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        fns = {"ours": lambda q, k, v: torch.ops.tk.attention(q, k, v, causal, scale)[0],
               **{n: (lambda q, k, v, f=f: f(q, k, v, causal, scale)) for n, f in baselines.items()}}
        # the fp32 reference on the first batch entry (the whole batch's scores would take tens of GB)
        want = torch.ops.tk.attention(q[:1].float(), k[:1].float(), v[:1].float(), causal, scale)[0]
        flops = 2.0 * B * H * N * N * (D + Dv) * (0.5 if causal else 1.0)
        rows += _checked_fwd_bwd(name, fns, fns["ours"](q, k, v)[:1], want, (q, k, v, do), flops, N, backward)
        del want
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


# (kind, B, Hq, Hkv, N, D, window): gpt-oss-120b's heads with sinks (global layers, and its 128-token sliding
# window); ModernBERT's local attention (a two-sided window of 64 keys on each side) at base and large widths
SINK_BAND_CASES = (
    ("sinks", 4, 64, 8, 4096, 64, 0),
    ("sinks", 4, 64, 8, 4096, 64, 128),
    ("band", 8, 12, 12, 8192, 64, 65),
    ("band", 8, 16, 16, 8192, 64, 65),
)


def run_sinks_and_bands(backward: bool = True) -> list[Row]:
    """Attention sinks (ours: tk::attention's o and lse rescaled, attention_sink_adapter) and two-sided windows (ours:
    tk::attention_varlen's interval tables) against compiled FlexAttention (sinks: its lse and the same rescale, in
    one compiled function) and, for the windows, SDPA with the dense mask HF's sdpa path hands it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from tk_inductor import build
    from tk_inductor.ops.attention import attention_sink_adapter

    build.load("attention")
    rows: list[Row] = []
    for kind, B, Hq, Hkv, N, D, window in SINK_BAND_CASES:
        name = (f"B{B} H{Hq}:{Hkv} N{N} D{D} " + ("causal, sinks" if kind == "sinks" else "two-sided")
                + (f" window {window}" if window else ""))
        progress(name)
        scale = 1.0 / math.sqrt(D)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, do = (torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        ii = torch.arange(N, device="cuda")
        if kind == "sinks":
            sink = torch.randn(1, Hq, 1, 1, device="cuda", generator=g)

            def visible(b, h, i, j):
                return (j <= i) & (i - j < window) if window else j <= i

            block_mask = create_block_mask(visible, None, None, N, N)

            @torch.compile
            def flex_sinks(q, k, v):
                o, lse = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True)
                return (o * torch.sigmoid(lse - sink.squeeze(-1)).unsqueeze(-1)).to(o.dtype)

            # ours compiled too, as the backend leaves it: Inductor fuses the rescale as it does Flex's
            @torch.compile
            def ours_sinks(q, k, v):
                return attention_sink_adapter(q, k, v, True, scale, window, 0.0, sink, (False, False, False))

            fns = {"ours": ours_sinks, "flex": flex_sinks}
            pairs = _visible(N, window)
        else:
            def visible(b, h, i, j):
                return (i - j <= window - 1) & (j - i <= window - 1)

            block_mask = create_block_mask(visible, None, None, N, N)
            flex = torch.compile(flex_attention)
            dense = (ii[:, None] - ii[None, :]).abs() < window

            def sdpa_mask(q, k, v):
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=True)

            fns = {"ours": lambda q, k, v: torch.ops.tk.attention_varlen(q, k, v, None, None, False, scale, window)[0],
                   "flex": lambda q, k, v: flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True),
                   "sdpa+mask": sdpa_mask}
            pairs = float(((ii[:, None] - ii[None, :]).abs() < window).sum())
        rows += _checked_fwd_bwd(name, fns, fns["ours"](q, k, v), fns["flex"](q, k, v), (q, k, v, do),
                                 4.0 * B * Hq * pairs * D, N, backward)
        del q, k, v, do, block_mask
        torch.cuda.empty_cache()
    return rows
