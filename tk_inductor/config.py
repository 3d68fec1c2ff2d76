"""One Config, resolved as defaults < environment < per-compile options.

The resolved config is hashed into cache keys (the pre-grad pass uuid), so
every field that changes what the rewrite does must live here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from typing import Iterator

# Also the order the rewrite runs the matchers in: rotary's anchor, x·cos + rot(x)·sin, before the norms, which would
# otherwise read that sum as a residual add in front of a norm that follows the rotation (HunYuan's q/k norms).
FAMILIES = ("attention", "linear_attention", "ssd", "rotary", "layernorm")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _as_bool(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    # A typo such as TK_INDUCTOR_STRICT=ture must not silently mean "on" (or "off").
    raise ValueError(f"tk_inductor: {name} must be a boolean (1/0, true/false, yes/no, on/off), not {value!r}")


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return _as_bool(value, name)


def _parse_ops(value, name: str = "ops") -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"tk_inductor: {name} must be a list of family names or a comma-separated string, not {value!r}")
    ops = tuple(dict.fromkeys(sorted(value) if isinstance(value, (set, frozenset)) else value))  # keep order, drop repeats
    if "all" in ops:
        return FAMILIES
    unknown = [op for op in ops if op not in FAMILIES]
    if unknown:
        raise ValueError(f"tk_inductor: {name}: unknown op families {unknown}; choose from {list(FAMILIES)} or 'all'")
    return ops


@dataclasses.dataclass(frozen=True)
class Config:
    ops: tuple[str, ...] = FAMILIES  # allowlist of families the rewrite may replace
    # families replaced in training graphs although they have no backward kernel: the forward runs the kernel, the
    # backward the op's reference autograd (batched PyTorch, recomputing the forward in fp32)
    reference_backward: tuple[str, ...] = ()
    strict: bool = False  # raise instead of warning and passing through
    reference: bool = False  # ops run their PyTorch reference (any device)
    verbose: bool = False  # print a one-line summary per compiled graph
    inner: str = "inductor"  # who compiles the rewritten graph: "inductor" or "aot_eager" (debugging)

    def replace(self, **changes) -> "Config":
        return _from_mapping(dataclasses.asdict(self) | changes)

    def key(self) -> str:
        """Stable hash of every field, for cache keys."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=list)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_OPTION_TYPES = {f.name: f.type for f in dataclasses.fields(Config)}


def _from_mapping(values: dict) -> Config:
    unknown = sorted(set(values) - set(_OPTION_TYPES))
    if unknown:
        raise ValueError(f"tk_inductor: unknown options {unknown}; known: {sorted(_OPTION_TYPES)}")
    values = dict(values)
    for name in ("ops", "reference_backward"):
        if name in values:
            values[name] = _parse_ops(values[name], name)
    for flag in ("strict", "reference", "verbose"):
        if flag in values:
            values[flag] = _as_bool(values[flag], f"options[{flag!r}]")
    if values.get("inner", "inductor") not in ("inductor", "aot_eager"):
        raise ValueError(f"tk_inductor: options['inner'] must be 'inductor' or 'aot_eager', not {values['inner']!r}")
    return Config(**values)


def from_environment(base: Config | None = None) -> Config:
    values = dataclasses.asdict(base or Config())
    if os.environ.get("TK_INDUCTOR_OPS"):
        values["ops"] = os.environ["TK_INDUCTOR_OPS"]
    if os.environ.get("TK_INDUCTOR_REFERENCE_BACKWARD") is not None:
        values["reference_backward"] = os.environ["TK_INDUCTOR_REFERENCE_BACKWARD"]
    for flag in ("strict", "reference", "verbose"):
        env = _env_flag(f"TK_INDUCTOR_{flag.upper()}")
        if env is not None:
            values[flag] = env
    return _from_mapping(values)


# Process-wide settings that `patch` changes (explicit code beats the environment).
_overrides: dict = {}


def current(options: dict | None = None) -> Config:
    """Defaults < environment < `patch` < options."""
    cfg = from_environment()
    if _overrides:
        cfg = cfg.replace(**_overrides)
    if options:
        cfg = cfg.replace(**options)
    return cfg


def flag_at_run_time(name: str) -> bool:
    """`getattr(current(), name)` for a boolean field, without building a Config: ops ask on every call."""
    if name in _overrides:
        return bool(_overrides[name])
    return bool(_env_flag(f"TK_INDUCTOR_{name.upper()}"))


def reference_at_run_time() -> bool:
    return flag_at_run_time("reference")


@contextlib.contextmanager
def patch(**changes) -> Iterator[Config]:
    """Temporarily change process-wide settings, e.g. `with config.patch(ops=["rotary"])`."""
    global _overrides
    saved = _overrides
    _from_mapping(dict(saved) | changes)  # validate before applying
    _overrides = dict(saved) | changes
    try:
        yield current()
    finally:
        _overrides = saved
