"""The `thunderkittens` torch.compile backend, and the same rewrite as Inductor's pre-grad pass.

    torch.compile(model, backend="thunderkittens")                      # via the entry point
    torch.compile(model, backend="thunderkittens", mode="max-autotune")
    torch.compile(model, backend="thunderkittens", options={"ops": ["attention"], "max_autotune": True})

torch.compile hands a non-Inductor backend `mode=` and `options=` only when
they are set (torch/__init__.py `_TorchCompileWrapper`), and refuses both at
once; so `options` may also carry "mode". Our keys (config.Config fields) are
taken out of `options`; the rest are Inductor config patches, validated and
combined with the mode by torch's own `_TorchCompileInductorWrapper`, exactly
as `torch.compile(backend="inductor")` would.
"""
from __future__ import annotations

import contextvars
import hashlib
from pathlib import Path
from typing import Any, Sequence

import torch

from . import config, rewrite

# Set while our backend compiles a graph, so the pre-grad pass (TK_INDUCTOR=1)
# does not rewrite and report the same graph a second time.
_in_backend: contextvars.ContextVar[bool] = contextvars.ContextVar("tk_inductor_in_backend", default=False)

_OUR_KEYS = frozenset(config.Config.__dataclass_fields__)

# Graphs Inductor failed on (graph code, input shapes/dtypes, patches): the same graph again (a model's repeated
# layers after graph breaks, recompiles) goes straight to aot_eager instead of failing again; on HF Mamba2 each
# failed Inductor attempt costs over a minute.
_inductor_failures: dict[str, str] = {}


def _graph_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], patches: dict) -> str:
    h = hashlib.sha256(gm.code.encode())
    for t in example_inputs:
        h.update(repr((tuple(t.shape), t.dtype, t.stride()) if isinstance(t, torch.Tensor) else type(t)).encode())
    h.update(repr(sorted(patches.items(), key=lambda kv: kv[0])).encode())
    return h.hexdigest()


def split_options(options: dict | None) -> tuple[dict, str | None, dict]:
    """options -> (our config options, mode, Inductor config patches)."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"tk_inductor: options must be a dict, not {type(options).__name__}")
    ours, inductor = {}, {}
    mode = None
    for key, value in (options or {}).items():
        if key in _OUR_KEYS:
            ours[key] = value
        elif key == "mode":
            mode = value
        else:
            inductor[key] = value
    return ours, mode, inductor


def inductor_config_patches(mode: str | None, options: dict | None) -> dict[str, Any]:
    """What `torch.compile(backend="inductor", mode=mode, options=options)` would patch.

    Delegates to torch's wrapper so mode tables, option validation (unknown
    keys, types) and side settings (CUPTI with cudagraphs) stay torch's."""
    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"tk_inductor: mode must be a string, not {type(mode).__name__}")
    wrapper = torch._TorchCompileInductorWrapper(mode, options or None, None)
    return dict(wrapper.config)


def thunderkittens(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None, options: dict | None = None):
    """Rewrite the Dynamo graph's hot subgraphs into `torch.ops.tk.*`, then compile the rest with Inductor."""
    ours, options_mode, inductor_options = split_options(options)
    if mode is not None and options_mode is not None and mode != options_mode:
        raise ValueError(f"tk_inductor: mode given twice ({mode!r} and options['mode']={options_mode!r})")
    mode = mode or options_mode
    cfg = config.current(ours)
    # Validate Inductor's part before doing any work, whichever compiler runs it.
    patches = inductor_config_patches(mode, inductor_options)
    mask_kinds = _output_mask_kinds(gm, cfg)  # on Dynamo's graph, before the rewrite touches it
    graph_report = rewrite.apply(gm, cfg)
    try:
        compiled = _compile(gm, example_inputs, cfg, patches)
    except BaseException:
        # Nothing was compiled: no report for this graph. (Dynamo also restarts its analysis through here, e.g.
        # to specialise a symbolic float that reached an op, and then compiles the graph again.)
        rewrite.discard(graph_report)
        raise
    return _prove_outputs(compiled, mask_kinds)


def _output_mask_kinds(gm: torch.fx.GraphModule, cfg: config.Config) -> dict[int, str]:
    if "attention" not in cfg.ops:
        return {}
    from .patterns import attention as attention_pattern

    return attention_pattern.output_mask_kinds(gm.graph)


def _prove_outputs(compiled, mask_kinds: dict[int, str]):
    """`compiled`, recording on each call the proven kinds of its mask outputs (see output_mask_kinds)."""
    if not mask_kinds:
        return compiled
    from .ops import attention_masked as masked_ops

    def run(*args):
        out = compiled(*args)
        flat = out if isinstance(out, (tuple, list)) else (out,)
        for i, kind in mask_kinds.items():
            if i < len(flat) and isinstance(flat[i], torch.Tensor):  # never fail the call over a proof
                masked_ops.prove_mask(flat[i], kind)
        return out

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # the calling convention Dynamo checks
    return run


def _compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], cfg: config.Config, patches: dict):
    """The rewritten graph through Inductor (or aot_eager: asked for, or after Inductor failed on it)."""
    token = _in_backend.set(True)
    try:
        from torch._dynamo.backends.debugging import aot_eager

        if cfg.inner == "aot_eager":
            return aot_eager(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        from . import _compat

        _compat.apply()
        if _compat.graph_has_scan(gm):
            _compat.disable_split_scans()
        key = None if cfg.strict else _graph_key(gm, example_inputs, patches)
        if key in _inductor_failures:
            return aot_eager(gm, example_inputs)
        from torch._inductor import config as inductor_config

        from . import post_grad

        # config_patches, not `with inductor_config.patch()`: the backward graph
        # is compiled later, outside any context manager opened here.
        chained = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
        patches = dict(patches, post_grad_custom_post_pass=post_grad.make_pass(cfg, chained))
        try:
            return compile_fx(gm, example_inputs, config_patches=patches)
        except Exception as exc:  # noqa: BLE001
            if cfg.strict:
                raise
            reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        # Inductor itself failed on this graph: run the rewritten graph through AOTAutograd without Inductor
        # rather than failing the user's model, our kernels included.
        _inductor_failures[key] = reason
        rewrite._warn_once(f"tk_inductor: Inductor failed on a graph ({reason}); running it with aot_eager "
                           "instead (and any identical graph after it)")
        return aot_eager(gm, example_inputs)
    finally:
        _in_backend.reset(token)


# ---------------------------------------------------------------------------- TK_INDUCTOR=1: pre-grad pass

def _pass_sources() -> list[Path]:
    """Python sources that decide what the rewrite does (matchers, ops, the pass, config)."""
    here = Path(__file__).resolve().parent
    from . import patterns

    files = [here / "rewrite.py", here / "autocast.py", here / "post_grad.py", here / "config.py", here / "backend.py"]
    files += sorted((here / "ops").glob("*.py"))
    for folder in {Path(p).resolve() for p in patterns.__path__}:
        files += sorted(folder.glob("*.py"))
    return files


def pass_uuid() -> str:
    """Cache identity of the pre-grad pass: pattern/op sources, config and kernel sources."""
    from . import build

    h = hashlib.sha256()
    for path in _pass_sources():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(config.current().key().encode())
    h.update(build.kernel_version().encode())
    return h.hexdigest()


def _import_ops() -> None:
    """Register every `tk::` op, and load the built kernel libraries (their raw `tk_cuda::` ops, which the
    post-grad pass calls directly). A cached Inductor artifact calls them, and with the pre-grad pass a cache hit
    runs no matcher that would import or load them."""
    import importlib
    import importlib.util

    from . import build

    for family in config.FAMILIES:
        name = f"tk_inductor.ops.{family}"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    if torch.cuda.is_available():
        for family in build.families():
            if build.is_built(family):
                build.try_load(family)


def _make_pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ThunderKittensPreGradPass(CustomGraphPass):
        """The backend's rewrite as Inductor's `pre_grad_custom_pass` (TK_INDUCTOR=1)."""

        def __init__(self, chained=None):
            self.chained = chained  # a pass the user had installed before us; runs after ours

        def __call__(self, graph: torch.fx.Graph) -> None:
            _import_ops()
            if not _in_backend.get():
                gm = graph.owning_module
                # Inductor recurses into subgraphs itself and calls us for each.
                rewrite.apply(gm, config.current(), recurse=False)
            if self.chained is not None:
                self.chained(graph)

        def uuid(self) -> str | None:
            _import_ops()  # asked before the cache lookup, so a hit finds the ops
            chained = None
            if self.chained is not None:
                chained = self.chained.uuid() if hasattr(self.chained, "uuid") else None
                if chained is None:  # an uncacheable user pass stays uncacheable
                    return None
            return pass_uuid() + (f"+{chained}" if chained is not None else "")

    return ThunderKittensPreGradPass


def install_pre_grad_pass(inductor_config=None) -> None:
    """Make every Inductor compile (default torch.compile) run the rewrite first, and the post-grad pass
    (tk_inductor/post_grad.py) on what AOTAutograd makes of it. Idempotent.

    `inductor_config` is the `torch._inductor.config` module, passed in by the
    autoload hook while that module is still being imported."""
    if inductor_config is None:
        from torch._inductor import config as inductor_config

    if not getattr(inductor_config.post_grad_custom_post_pass, "_tk_inductor", False):
        from . import post_grad

        inductor_config.post_grad_custom_post_pass = post_grad.make_pass(None, inductor_config.post_grad_custom_post_pass)
    current = inductor_config.pre_grad_custom_pass
    if getattr(current, "_tk_inductor", False):
        return
    instance = _make_pass_class()(chained=current)
    instance._tk_inductor = True
    inductor_config.pre_grad_custom_pass = instance
