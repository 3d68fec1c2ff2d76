"""Counter-based RNG (Philox4x32-R) in plain PyTorch, bit-identical to the kernels' device code.

The dropout masks of the layernorm and attention families are pure functions of (seed, offset, element), so the
backward regenerates them instead of storing them, and the reference (this file) reproduces the kernels' masks
exactly on any device.

Stream layouts (the generator itself is csrc/include/tk/ops/thread/philox.cuh):
* layernorm (csrc/kernels/layernorm/philox.cuh), Philox4x32-10: element e of the flattened (rows, hidden) tensor uses
  word (e % 4) of philox(key=(seed_lo, seed_hi), counter=(g_lo, g_hi, offset_lo, offset_hi)), g = e // 4, and is kept
  iff the word >= threshold(p), threshold(p) = min(floor(p * 2^32), 2^32 - 1);
* attention (csrc/kernels/attention/dropout.cuh), Philox4x32-7: probability (bh, i, j) (query head bh = b * Hq + h,
  query i, key j) uses 16-bit half h = (i // 8) % 2 + 2 * (j % 2) + 4 * ((j // 8) % 2) of the words of
  philox(key=(seed_lo, seed_hi), counter=(jg, ig, bh, offset_lo)), ig = (i // 16) * 8 + i % 8,
  jg = (j // 16) * 4 + (j % 8) // 2 (word h // 2, its low half for even h; eight elements share a call), and is kept iff
  that half >= threshold(p) >> 16 = floor(p * 2^16): p at 16-bit resolution (one call per 8 elements, as the
  generator is the attention kernels' hot spot).
Integer comparison (rather than a float uniform) keeps the reference and the kernel
bit-identical for every p.

Seeds are drawn from PyTorch's default CPU generator whatever the device, so
`torch.manual_seed` makes runs reproducible, no device sync is needed, and a CPU
reference run gives the same mask as the GPU kernel.
"""
from __future__ import annotations

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
ROUNDS = 10  # the default round count (the layernorm stream)
ATTENTION_ROUNDS = 7  # attention's stream: 7 rounds pass BigCrush (Salmon et al.), and its generator is its hot spot
MASK32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * m for a < 2^32 held in int64, without int64 overflow."""
    m_lo, m_hi = m & 0xFFFF, m >> 16
    p_lo = a * m_lo  # < 2^48
    p_hi = a * m_hi  # < 2^48
    t = (p_lo >> 16) + p_hi  # a*m = t * 2^16 + (p_lo & 0xFFFF), t < 2^49
    hi = t >> 16
    lo = ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)
    return hi, lo


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[int, int],
               rounds: int = ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32-`rounds` of int64 tensors holding 32-bit counter words; returns the 4 output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key[0] & MASK32, key[1] & MASK32
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        hi0, lo0 = _mulhilo(c0, M0)
        hi1, lo1 = _mulhilo(c2, M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """The 32-bit keep threshold for drop probability p (same expression as the kernel)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return min(int(p * 4294967296.0), MASK32)


def random_words(numel: int, seed: int, offset: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32-bit words (int64 tensor, flat) that elements 0..numel-1 compare against the threshold."""
    seed &= _U64
    offset &= _U64
    groups = (numel + 3) // 4
    g = torch.arange(groups, dtype=torch.int64, device=device)
    zeros = torch.zeros_like(g)
    counter = (g & MASK32, (g >> 32) & MASK32, zeros + (offset & MASK32), zeros + (offset >> 32))
    words = philox4x32(counter, (seed & MASK32, seed >> 32))
    return torch.stack(words, dim=-1).reshape(-1)[:numel]


def keep_mask(shape, seed: int, offset: int, p: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean keep-mask of `shape` (flattened row-major), bit-identical to the kernels' dropout."""
    numel = 1
    for s in shape:
        numel *= int(s)
    words = random_words(numel, seed, offset, device)
    return (words >= threshold(p)).reshape(tuple(shape))


def attention_keep_mask(heads: int, N: int, M: int, seed: int, offset: int, p: float,
                        device: torch.device | str = "cpu", head0: int = 0) -> torch.Tensor:
    """Boolean keep-mask (heads, N, M) of attention's dropout over query heads b * Hq + h = head0 .. head0 + heads - 1,
    queries and keys, bit-identical to the attention kernels' (csrc/kernels/attention/dropout.cuh)."""
    seed &= _U64
    i = torch.arange(N, dtype=torch.int64, device=device).view(1, N, 1)
    j = torch.arange(M, dtype=torch.int64, device=device).view(1, 1, M)
    bh = torch.arange(head0, head0 + heads, dtype=torch.int64, device=device).view(heads, 1, 1)
    shape = (heads, N, M)
    counter = (((j >> 4) * 4 + ((j & 7) >> 1)).expand(shape), ((i >> 4) * 8 + (i & 7)).expand(shape),
               bh.expand(shape), torch.full(shape, offset & MASK32, dtype=torch.int64, device=device))
    words = torch.stack(philox4x32(counter, (seed & MASK32, seed >> 32), ATTENTION_ROUNDS), dim=-1)
    h = ((i >> 3) & 1) + 2 * (j & 1) + 4 * ((j >> 3) & 1)
    word = torch.gather(words, -1, (h >> 1).expand(shape).unsqueeze(-1)).squeeze(-1)
    half = (word >> (16 * (h & 1))) & 0xFFFF
    return half >= (threshold(p) >> 16)


def dropout_scale(p: float) -> float:
    """1 / (1 - p) rounded to fp32 once, as the kernels receive it."""
    return float(torch.tensor(1.0 / (1.0 - p), dtype=torch.float32))


def draw_seed() -> torch.Tensor:
    """A fresh (seed, offset) pair as a CPU int64 tensor, from the default CPU generator."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device="cpu")


def is_rng(rng) -> bool:
    """Whether `rng` is a (seed, offset) pair as the ops take it: a CPU int64 tensor of two elements."""
    return isinstance(rng, torch.Tensor) and rng.device.type == "cpu" and rng.dtype == torch.int64 and rng.numel() == 2


def unpack(rng: torch.Tensor) -> tuple[int, int]:
    """(seed, offset) as unsigned 64-bit Python ints from a CPU int64 tensor of two elements."""
    if not is_rng(rng):
        got = (f"{rng.dtype} {tuple(rng.shape)} on {rng.device}" if isinstance(rng, torch.Tensor)
               else type(rng).__name__)
        raise ValueError(f"rng must be a CPU int64 tensor of 2 elements (seed, offset), got {got}")
    seed, offset = (int(v) & _U64 for v in rng.tolist())
    return seed, offset


@torch.library.custom_op("tk::philox_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def philox_seed() -> torch.Tensor:
    """draw_seed as a graph node: the (seed, offset) pair the backend's rewrite draws for an op it gives dropout
    (tk::attention), once per run of the graph; the tag keeps compilers from merging or recomputing it."""
    return draw_seed()


@philox_seed.register_fake
def _philox_seed_fake() -> torch.Tensor:
    return torch.empty(2, dtype=torch.int64, device="cpu")
