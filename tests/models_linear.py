"""Small linear-attention modules (Based / Hedgehog / plain) in the spellings users write.

Used by tests/linear_attention/test_linear_attention.py (matching + reference-mode equivalence) and by benchmarks
(as "torch-reference layers"). Layout inside the mixers is (B, H, N, d), as in the Based code.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------- feature maps

class TaylorExp(nn.Module):
    """Based's 2nd-order Taylor map: φ(q)·φ(k) = 1 + q·k/√d + (q·k)²/(2d)."""

    def __init__(self, dim: int, ones: str = "pow0"):
        super().__init__()
        self.r2, self.rd, self.rrd = math.sqrt(2), math.sqrt(dim), dim ** 0.25
        self.ones = ones

    def forward(self, x):
        x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(start_dim=-2) / self.r2
        one = x[..., :1] ** 0 if self.ones == "pow0" else torch.ones_like(x[..., 0:1])
        return torch.cat([one, x / self.rrd, x2 / self.rd], dim=-1)


class Hedgehog(nn.Module):
    """Hedgehog paper map: cat(softmax(x W), softmax(-x W)), W per head (or shared)."""

    def __init__(self, heads: int, dim: int, feature: int, per_head: bool = True):
        super().__init__()
        shape = (heads, dim, feature) if per_head else (dim, feature)
        self.weight = nn.Parameter(torch.randn(shape) / math.sqrt(dim))
        self.per_head = per_head

    def forward(self, x):
        z = torch.einsum("hdf,bhnd->bhnf", self.weight, x) if self.per_head else x @ self.weight
        return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


class LolcatsHedgehog(nn.Module):
    """LoLCATs-style Hedgehog map: per-head einsum (weight first) plus a bias, both softmaxes, clamped from below.
    A per-head bias (H, 1, 1) is constant along the softmax dim (read as no bias); one over the features is not
    (`bias="features"`: the map goes in as identity features). The clamp at 1e-12 is read as none; a large one
    (`clamp=1e-2`) is not."""

    def __init__(self, heads: int, dim: int, feature: int, bias: str = "heads", clamp: float = 1e-12):
        super().__init__()
        self.layer = nn.Parameter(torch.randn(heads, dim, feature) / math.sqrt(dim))
        self.bias = nn.Parameter(torch.randn(1, heads, 1, 1 if bias == "heads" else feature))
        self.clamp = clamp

    def forward(self, x):
        z = torch.einsum("hdf,bhld->bhlf", self.layer, x) + self.bias
        return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1).clamp(min=self.clamp)


class FLAHedgehog(nn.Module):
    """flash-linear-attention's HedgehogFeatureMap: ONE softmax over cat([2(xW+b), -2(xW+b)]).

    Not the op's "hedgehog" (two separate softmaxes): the rewrite must not call it that."""

    def __init__(self, dim: int):
        super().__init__()
        self.layer = nn.Linear(dim, dim)

    def forward(self, x):
        y = 2 * self.layer(x)
        return torch.cat([y, -y], dim=-1).softmax(-1)


class FLATaylor(nn.Module):
    """flash-linear-attention's current TaylorFeatureMap: the same kernel 1 + s + s²/2 as Based's
    map, but the quadratic term gathered from the upper triangle of x⊗x (diagonal /√2·√d,
    off-diagonal /√d). Not spelled like the Taylor map we read: must go in as "identity"."""

    def __init__(self, dim: int):
        super().__init__()
        self.rd, self.r2 = math.sqrt(dim), math.sqrt(2)

    def forward(self, x):
        z = torch.einsum("...i,...j->...ij", x, x)
        n = z.size(-1)
        off = torch.triu_indices(n, n, 1, device=x.device)
        diag = torch.arange(n, device=x.device)
        return torch.cat([torch.ones_like(x[..., 0:1]), x / self.rd ** 0.5, z[..., diag, diag] / (self.rd * self.r2),
                          z[..., off[0], off[1]] / self.rd], dim=-1)


class Elu1(nn.Module):
    def forward(self, x):
        return F.elu(x) + 1


class Identity(nn.Module):
    def forward(self, x):
        return x


def make_feature_map(name: str, heads: int, dim: int):
    if name == "based":
        return TaylorExp(dim)
    if name == "based_ones_like":
        return TaylorExp(dim, ones="ones_like")
    if name == "hedgehog":
        return Hedgehog(heads, dim, dim)
    if name == "hedgehog_shared":
        return Hedgehog(heads, dim, dim, per_head=False)
    if name == "hedgehog_lolcats":
        return LolcatsHedgehog(heads, dim, dim)
    if name == "hedgehog_feature_bias":
        return LolcatsHedgehog(heads, dim, dim, bias="features")
    if name == "hedgehog_large_clamp":
        return LolcatsHedgehog(heads, dim, dim, clamp=1e-2)
    if name == "fla_hedgehog":
        return FLAHedgehog(dim)
    if name == "fla_taylor":
        return FLATaylor(dim)
    if name == "elu1":
        return Elu1()
    if name == "identity":
        return Identity()
    raise ValueError(name)


# ---------------------------------------------------------------------------- the mixer

class LinearAttention(nn.Module):
    """Projection -> feature map -> causal linear attention (one of several spellings) -> projection.

    form:
      "quadratic"      ((φq φkᵀ) masked by tril) v, normaliser = row sum of the masked scores
      "masked_fill"    scores.masked_fill(~tril(ones(bool)), 0)
      "mask_mul"       scores * tril(ones) (a float 0/1 mask)
      "arange"         where(arange(n)[:, None] >= arange(n)[None, :], scores, 0)
      "based"          Based repo: einsum scores, torch.tril, einsum with v,
                       y * 1/(einsum(φq, cumsum(φk)) + eps)
      "cumsum"         kv = cumsum(einsum(φk, v)), o = einsum(φq, kv), den = (φq * cumsum(φk)).sum
      "cumsum_bcast"   kv = cumsum(φk[..., None] * v[..., None, :]), o = (φq[..., None] * kv).sum(-2)
      "taylor_scores"  FLA naive_parallel_based: s = (q·scale) kᵀ, 1 + s + s²/2, masked, @ v
    Must-not-replace variants: "noncausal" (no mask), "window" (banded mask), "input_mask" (the
    mask is a module input, not provable), "upper" (a triu mask: anti-causal).
    """

    def __init__(self, d_model=32, heads=2, feature_dim=8, head_dim=8, feature_map="elu1",
                 form="quadratic", normalize=True, eps=1e-6, scale=1.0):
        super().__init__()
        self.h, self.f, self.e = heads, feature_dim, head_dim
        self.q = nn.Linear(d_model, heads * feature_dim, bias=False)
        self.k = nn.Linear(d_model, heads * feature_dim, bias=False)
        self.v = nn.Linear(d_model, heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, d_model, bias=False)
        self.fm_q = make_feature_map(feature_map, heads, feature_dim)
        separate = feature_map.startswith("hedgehog") and feature_map != "hedgehog_shared"
        self.fm_k = make_feature_map(feature_map, heads, feature_dim) if separate else self.fm_q
        self.form, self.normalize, self.eps, self.scale = form, normalize, eps, scale

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.f).transpose(1, 2)
        k = self.k(x).view(b, n, self.h, self.f).transpose(1, 2)
        v = self.v(x).view(b, n, self.h, self.e).transpose(1, 2)
        y = self.mix(q, k, v, mask)
        return self.o(y.transpose(1, 2).reshape(b, n, self.h * self.e))

    def mix(self, q, k, v, mask=None):
        form, eps, n = self.form, self.eps, q.shape[2]
        if form == "taylor_scores":
            s = (q * self.scale) @ k.transpose(-2, -1)
            a = 1 + s + 1 / 2 * (s ** 2)
            a = a.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device)), 0)
            o = a @ v
            return o / (a.sum(-1)[..., None] + eps) if self.normalize else o
        fq, fk = self.fm_q(q), self.fm_k(k)
        if form == "based":
            a = torch.tril(torch.einsum("bhnd,bhmd->bhnm", fq, fk))
            y = torch.einsum("bhnm,bhme->bhne", a.to(q.dtype), v.to(q.dtype))
            if not self.normalize:
                return y
            z = 1 / (torch.einsum("bhld,bhld->bhl", fq, fk.cumsum(2)) + eps)
            return y * z[..., None]
        if form in ("cumsum", "cumsum_bcast"):
            if form == "cumsum":
                kv = torch.einsum("bhnd,bhne->bhnde", fk, v).cumsum(2)
                o = torch.einsum("bhnd,bhnde->bhne", fq * self.scale, kv)
            else:
                kv = torch.cumsum(fk[..., None] * v[..., None, :], dim=2)
                o = (fq.unsqueeze(-1) * self.scale * kv).sum(-2)
            if not self.normalize:
                return o
            z = (fq * self.scale * fk.cumsum(2)).sum(-1, keepdim=True)
            return o / (z + eps)
        a = fq @ fk.transpose(-2, -1) * self.scale
        if form == "quadratic":
            a = torch.tril(a)
        elif form == "masked_fill":
            a = a.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device)), 0.0)
        elif form == "mask_mul":
            a = a * torch.tril(torch.ones(n, n, device=q.device))
        elif form == "arange":
            i = torch.arange(n, device=q.device)
            a = torch.where(i[:, None] >= i[None, :], a, 0.0)
        elif form == "window":
            i = torch.arange(n, device=q.device)
            keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4)
            a = torch.where(keep, a, 0.0)
        elif form == "upper":
            a = torch.triu(a)
        elif form == "input_mask":
            a = a * mask
        elif form != "noncausal":
            raise ValueError(form)
        o = a @ v
        return o / (a.sum(-1, keepdim=True) + eps) if self.normalize else o


class TinyLM(nn.Module):
    """Embedding -> [norm -> linear attention + residual] x layers -> head: a whole small model."""

    def __init__(self, vocab=64, d_model=32, layers=2, **mixer):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.mixers = nn.ModuleList(LinearAttention(d_model=d_model, **mixer) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return self.head(x)
