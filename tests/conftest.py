"""Shared test setup: every test starts from a clean tk_inductor state.

The TK_INDUCTOR_* variables of the calling shell would otherwise change what
the rewrite does (TK_INDUCTOR_CACHE_DIR is kept: it only says where built
kernels live). GPU tests are marked `gpu` and skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

_BEHAVIOUR_VARS = ("TK_INDUCTOR", "TK_INDUCTOR_OPS", "TK_INDUCTOR_STRICT", "TK_INDUCTOR_REFERENCE", "TK_INDUCTOR_VERBOSE")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_tk_state(monkeypatch):
    from tk_inductor import rewrite

    for name in _BEHAVIOUR_VARS:
        monkeypatch.delenv(name, raising=False)
    from tk_inductor import backend

    rewrite.reset()
    rewrite._warned.clear()
    backend._inductor_failures.clear()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    rewrite.reset()
