"""A Based-style language model in plain PyTorch (arXiv 2402.18668's layer mix).

Taylor-feature-map linear attention layers (feature dim 16, second-order
Taylor map, causal, normalised) interleaved with short sliding-window softmax
attention, pre-RMSNorm residual blocks and a SwiGLU MLP. Written the way
research code spells it, so it exercises the linear_attention, layernorm and
(not replaced: sliding window) attention matchers.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class BasedConfig:
    vocab_size: int = 32000
    hidden: int = 1024
    layers: int = 12
    heads: int = 16
    feature_dim: int = 16  # per-head q/k projection for the Taylor map
    window: int = 64  # sliding-window softmax attention span
    window_every: int = 3  # every 3rd layer is a sliding-window layer
    mlp_ratio: float = 8 / 3
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(q)·phi(k) = 1 + s + s²/2 with s = q·k/√d."""
    d = x.shape[-1]
    x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2)
    return torch.cat([torch.ones_like(x[..., :1]), x / d**0.25, x2 / math.sqrt(d)], dim=-1)


class TaylorLinearAttention(nn.Module):
    def __init__(self, cfg: BasedConfig):
        super().__init__()
        self.heads, self.fd = cfg.heads, cfg.feature_dim
        self.head_dim = cfg.hidden // cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.heads * cfg.feature_dim, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.heads * cfg.feature_dim, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.eps = 1e-12

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.fd).transpose(1, 2)
        k = self.k(x).view(b, n, self.heads, self.fd).transpose(1, 2)
        v = self.v(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        q, k = taylor_feature_map(q), taylor_feature_map(k)
        scores = (q @ k.transpose(-1, -2)).tril()  # causal quadratic form
        out = (scores @ v) / (scores.sum(-1, keepdim=True) + self.eps)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class SlidingWindowAttention(nn.Module):
    def __init__(self, cfg: BasedConfig):
        super().__init__()
        self.heads, self.window = cfg.heads, cfg.window
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        i = torch.arange(n, device=x.device)
        visible = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, cfg: BasedConfig, layer: int):
        super().__init__()
        sliding = layer % cfg.window_every == cfg.window_every - 1
        self.mix = SlidingWindowAttention(cfg) if sliding else TaylorLinearAttention(cfg)
        self.norm1, self.norm2 = RMSNorm(cfg.hidden, cfg.eps), RMSNorm(cfg.hidden, cfg.eps)
        inner = int(cfg.hidden * cfg.mlp_ratio)
        self.up = nn.Linear(cfg.hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, cfg.hidden, bias=False)

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class BasedLM(nn.Module):
    def __init__(self, cfg: BasedConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
