"""Shared test setup: every test starts from a clean tk_inductor state.

The TK_INDUCTOR_* variables of the calling shell would otherwise change what
the rewrite does (TK_INDUCTOR_CACHE_DIR is kept: it only says where built
kernels live). GPU tests are marked `gpu` and skipped without CUDA.
"""
from __future__ import annotations

import sys

import pytest
import torch

_BEHAVIOUR_VARS = ("TK_INDUCTOR", "TK_INDUCTOR_OPS", "TK_INDUCTOR_STRICT", "TK_INDUCTOR_REFERENCE", "TK_INDUCTOR_VERBOSE")


def pytest_addoption(parser):
    parser.addoption("--fuzz", type=int, default=100, metavar="N",
                     help="random configurations per kernel family in tests/backend/test_fuzz_gpu.py (default 100)")
    parser.addoption("--fuzz-seed", type=int, default=0, metavar="S", help="the fuzz's base seed (default 0)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_TORCH_CONFIGS = ("torch._inductor.config", "torch._functorch.config", "torch._dynamo.config")


def _config_state() -> dict[str, dict]:
    """The visible options of torch's config modules that are loaded, by module."""
    state = {}
    for name in _TORCH_CONFIGS:
        module = sys.modules.get(name)
        if module is not None:
            state[name] = {k: v for k, v in module.get_config_copy().items()}
            state[name]["<hidden>"] = sorted(k for k, e in module._config.items() if getattr(e, "hide", False))
    return state


@pytest.fixture(autouse=True)
def _torch_config_untouched():
    """Every test leaves torch's Inductor/functorch/Dynamo config as it found it (patch with the modules' own
    `patch()`: `monkeypatch.setattr` on them deletes the option on undo in pytest >= 9.2, breaking later tests)."""
    before = _config_state()
    yield
    after = _config_state()
    changed = []
    for name, options in before.items():
        now = after.get(name, {})
        changed += [f"{name}.{k}" for k, v in options.items() if k not in now or now[k] is not v and now[k] != v]
    assert not changed, f"the test left torch config changed: {changed}"


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


@pytest.fixture
def replaced_matches(monkeypatch):
    """The matches the rewrite replaces during the test, in order (a spy on rewrite._replace)."""
    from tk_inductor import rewrite

    seen = []
    real = rewrite._replace

    def spy(graph, match, remap):
        seen.append(match)
        return real(graph, match, remap)

    monkeypatch.setattr(rewrite, "_replace", spy)
    return seen
