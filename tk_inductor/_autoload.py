"""`torch.backends` entry point: torch calls `autoload()` at the end of `import torch`.

Without TK_INDUCTOR=1 it returns at once. With it, the rewrite becomes
Inductor's `pre_grad_custom_pass`, so an unchanged `torch.compile(model)`
swaps kernels too. Importing Inductor costs about a second (it pulls in
Dynamo), so instead of importing it here we wait for the first import of
`torch._inductor.config` (which every Inductor compile does) and install the
pass right after that module has run.
"""
from __future__ import annotations

import os
import sys

_INDUCTOR_CONFIG = "torch._inductor.config"


def enabled() -> bool:
    return os.environ.get("TK_INDUCTOR", "").strip().lower() not in ("", "0", "false", "no", "off")


def _install(inductor_config) -> None:
    from .backend import install_pre_grad_pass

    install_pre_grad_pass(inductor_config)


class _AfterImport:
    """A one-shot meta-path finder: runs `_install` once `torch._inductor.config` has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _INDUCTOR_CONFIG:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run_module = loader.exec_module

        def exec_module(module):
            run_module(module)
            _install(module)

        # The loader is this spec's own instance (a SourceFileLoader per file).
        loader.exec_module = exec_module
        return spec


def autoload() -> None:
    if not enabled():
        return
    if _INDUCTOR_CONFIG in sys.modules:
        _install(sys.modules[_INDUCTOR_CONFIG])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
