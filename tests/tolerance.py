"""Tolerances for values that a compiled graph sums in another order than eager does (gradients above all)."""
from __future__ import annotations

import math

import torch


def summed(ref: torch.Tensor, terms: int, slack: float = 4.0, floor: float = 0.0) -> dict:
    """assert_close tolerances for `ref`, a sum of `terms` rounded terms computed in another order.

    Reordering such a sum moves it by about eps * sqrt(terms) of the terms' magnitude, so that is the absolute
    tolerance (times `slack`). The magnitude is the tensor's largest element, or `floor` where that is larger: a
    value that is zero in exact arithmetic (a key bias's gradient under softmax) is a cancellation of terms as large
    as the other values. A fixed atol is either loose for small tensors or flaky for large sums."""
    eps = torch.finfo(ref.dtype).eps
    scale = max(ref.detach().abs().max().item() if ref.numel() else 0.0, floor, 1e-12)
    return {"rtol": 1e-4, "atol": slack * eps * math.sqrt(terms) * scale}
