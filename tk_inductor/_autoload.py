"""`torch.backends` entry point: torch calls `autoload()` during `import torch`.

It must be nearly free and must not import torch submodules at module level
(torch is half-initialised when this runs). It does nothing unless
TK_INDUCTOR=1; then it installs the rewrite as Inductor's pre-grad pass.
"""
from __future__ import annotations

import os


def _enabled() -> bool:
    return os.environ.get("TK_INDUCTOR", "").strip().lower() not in ("", "0", "false", "no", "off")


def autoload() -> None:
    if not _enabled():
        return
    from .backend import install_pre_grad_pass

    install_pre_grad_pass()
