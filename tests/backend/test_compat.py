"""The torch work-arounds in tk_inductor._compat: each fixes its bug where present and does nothing elsewhere."""
import types

import pytest
import sympy

from tk_inductor import _compat


def _split(groups, lengths):
    from types import SimpleNamespace

    from torch._inductor.codegen.simd import SIMDKernel
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    with V.set_graph_handler(SimpleNamespace(sizevars=SizeVarAllocator())):
        return SIMDKernel._split_iteration_ranges([sympy.Integer(g) for g in groups],
                                                  [[sympy.Integer(n) for n in ls] for ls in lengths])


def test_unsplittable_bmm_then_pointwise_raises_cantsplit():
    """(2, 3, 5, 1) with a pointwise length of 31 takes the three-way split and cannot divide: Inductor must see
    CantSplit (and try another tiling), not the TypeError torch 2.11's bare `raise CantSplit` produces."""
    from torch._inductor.codegen.simd import CantSplit

    _compat.patch_cantsplit()
    with pytest.raises(CantSplit):
        _split((2, 3, 5, 1), [[31], []])
    assert _split((2, 3, 5, 1), [[30], []])[0] == [[2], [3], [5], []]


def _fake_simd(bare: bool):
    class CantSplit(Exception):
        def __init__(self, expr, remaining):
            super().__init__()
            self.expr, self.remaining = expr, remaining

    namespace = {"CantSplit": CantSplit}
    body = "raise CantSplit" if bare else "raise CantSplit(1, 2)"
    exec(f"class SIMDKernel:\n    @staticmethod\n    def _split_iteration_ranges():\n        {body}\n", namespace)
    return types.SimpleNamespace(CantSplit=CantSplit, SIMDKernel=namespace["SIMDKernel"])


def test_cantsplit_patch_only_where_the_bare_raise_is(monkeypatch):
    import inspect

    sources = {}
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: sources.get(obj) or real(obj))
    fixed, buggy = _fake_simd(False), _fake_simd(True)
    sources[fixed.SIMDKernel._split_iteration_ranges] = "def f():\n    raise CantSplit(1, 2)\n"
    sources[buggy.SIMDKernel._split_iteration_ranges] = "def f():\n    raise CantSplit\n"
    assert not _compat.patch_cantsplit(fixed)
    with pytest.raises(TypeError):
        fixed.CantSplit()
    assert _compat.patch_cantsplit(buggy)
    assert not _compat.patch_cantsplit(buggy)  # once
    err = buggy.CantSplit()
    assert isinstance(err, buggy.CantSplit) and err.expr is None and err.remaining is None
    assert buggy.CantSplit(3, 4).remaining == 4


def test_disable_split_scans_on_a_stand_in_ir():
    """The patch makes every scan one block (num_splits 1), once; the real ir is left alone here."""
    class Scan:
        @classmethod
        def num_splits(cls, **kwargs):
            return "outer", 8

    ir = types.SimpleNamespace(Scan=Scan, ReductionHint=types.SimpleNamespace(DEFAULT="default"))
    assert _compat.disable_split_scans(ir) is True
    assert Scan.num_splits(device="cuda", dtype=None) == ("default", 1)
    assert _compat.disable_split_scans(ir) is False  # already off
    assert _compat.disable_split_scans(types.SimpleNamespace()) is False  # nothing to patch


def test_graph_has_scan():
    import torch
    import torch.fx as fx

    assert _compat.graph_has_scan(fx.symbolic_trace(lambda x: torch.cumsum(x, 0)))
    assert _compat.graph_has_scan(fx.symbolic_trace(lambda x: x.cumprod(1) + 1))
    assert not _compat.graph_has_scan(fx.symbolic_trace(lambda x: x.sum(0) * 2))


@pytest.mark.parametrize("no_split_scans", [False, True])
def test_split_scan_codegen_without_a_gpu(no_split_scans, tmp_path):
    """Inductor's CUDA code generation for HF Mamba2's scan over a strided axis, on this machine with the device
    faked (tests/backend/fake_cuda_inductor.py): torch 2.11 and 2.14 fail in the split-scan kernel; with split scans off
    the code is generated, with a one-block scan."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("fake_cuda_inductor.py")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), TORCHINDUCTOR_FX_GRAPH_CACHE="0")
    args = [sys.executable, str(script)] + (["--no-split-scans"] if no_split_scans else [])
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["codegen"] == "harness":
        pytest.skip(f"this torch needs more faking: {result['detail']}")
    if no_split_scans:
        assert result == {"codegen": "ok", "detail": "", "split_scan": False}, result
    elif result["codegen"] == "failed":  # the bug; a torch that fixed it generates the split scan instead
        assert result["split_scan"], result
