"""CPU checks of benchmarks/sweep_ln.py's bookkeeping (the device run gets one shot)."""
from __future__ import annotations

import os

import torch

from benchmarks import sweep_ln


def test_variants_sets_and_restores_the_environment(monkeypatch):
    monkeypatch.delenv("TK_LN_FWD_VARIANT", raising=False)
    monkeypatch.setenv("TK_LN_BWD_VARIANT", "3")
    with sweep_ln.variants(fwd=1, bwd=2):
        assert os.environ["TK_LN_FWD_VARIANT"] == "1" and os.environ["TK_LN_BWD_VARIANT"] == "2"
    assert "TK_LN_FWD_VARIANT" not in os.environ and os.environ["TK_LN_BWD_VARIANT"] == "3"
    with sweep_ln.variants(bwd=0):
        assert "TK_LN_FWD_VARIANT" not in os.environ and os.environ["TK_LN_BWD_VARIANT"] == "0"


def test_correctness_cases_cover_the_brief():
    cases = list(sweep_ln.correctness_cases())
    assert {c[0] for c in cases} >= {1, 17, 1000}
    assert {c[1] for c in cases} >= {8, 1000, 1024, 4096, 16384}
    bf16 = [c for c in cases if c[2] == torch.bfloat16]
    assert any(c[3] for c in bf16) and any(not c[3] for c in bf16)  # with and without residual
    assert any(c[6] > 0 for c in bf16) and any(c[6] == 0 for c in bf16)  # with and without dropout
    assert any(c[7] for c in bf16) and any(not c[7] for c in bf16)  # RMSNorm and LayerNorm
    assert not any(c[7] and c[5] for c in cases)  # RMSNorm takes no bias
    assert {c[2] for c in cases} == {torch.bfloat16, torch.float16, torch.float32}


def test_table_reports_figures_errors_and_ratio():
    timings = [{"hidden": 1024, "kernels": {"fwd v1": ["forward_pipe_kernel"]},
                "fwd": {"v0": {"ms": 0.2, "gbs": 2000.0}, "v1": {"ms": 0.1, "gbs": 4000.0},
                        "compile": {"ms": 0.15, "gbs": 3000.0}},
                "bwd": {"v0": {"error": "launch failed"}}}]
    text = sweep_ln.table(timings, 4000.0, [0, 1], [0])
    assert "4000 (100%)" in text and "2000 (50%)" in text
    assert "| 1.50 |" in text  # best of ours (0.1 ms) against torch.compile (0.15 ms)
    assert "ERR hidden 1024 bwd v0: launch failed" in text
    assert "fwd v1: forward_pipe_kernel" in text
