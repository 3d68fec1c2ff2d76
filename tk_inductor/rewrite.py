"""Run the pattern families over a Dynamo (torch-IR) graph: match -> check -> replace.

Autocast's casts are made explicit first (tk_inductor/autocast.py), so a graph compiled under `torch.autocast`
is matched as in one precision. Each family lives in `tk_inductor.patterns.<family>` and exposes

    def find(graph: torch.fx.Graph, cfg: Config) -> Iterable[Match]

returning every occurrence of its computation. A matcher fills `Match.reason`
itself when the computation is recognised but cannot be proven equal to the
op (an arbitrary mask, dropout p>0, unsupported dtype/head dim ...). This module
adds the checks shared by all families (allowlist, device, kernel built,
training without a backward kernel), replaces what passes, and records
everything in the report.

`apply` is the entry used by the backend and the pre-grad pass: it owns the
failure policy (warn once and pass the graph through untouched; `strict`
raises). `run` is the bare in-place pass underneath it.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import logging
import operator
import sys
import warnings
from collections import Counter
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from . import build
from .config import FAMILIES, Config

log = logging.getLogger("tk_inductor")


class RewriteError(RuntimeError):
    """Raised in strict mode where the default policy would warn and pass through."""


class Derived:
    """A match argument computed from a graph node by one tensor method, inserted in front of the op when the match
    is replaced (`node` is the field every subclass has)."""

    node: fx.Node

    def method(self) -> tuple[str, tuple]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Cast(Derived):
    """`node.to(dtype)`. A matcher that looks through a cast (autocast's, made explicit) to the tensor behind views
    of it hands the op that tensor cast instead: fewer bytes where the views repeat it (GQA's repeat_kv), and the
    cast stands alone where a producer op can write its dtype directly (rotary)."""

    node: fx.Node
    dtype: torch.dtype

    def method(self):
        return "to", (self.dtype,)


@dataclasses.dataclass(frozen=True)
class Transpose(Derived):
    """`node.transpose(1, 2)`: a tensor the replaced code used tokens-first, (B, N, H, d), that the op takes
    heads-first, or the reverse (a strided view the kernels read in place, or the binding copies)."""

    node: fx.Node

    def method(self):
        return "transpose", (1, 2)


@dataclasses.dataclass(frozen=True)
class Squeeze(Derived):
    """`node.squeeze(dim)`: a tensor the replaced code used with an extra unit axis (an SSD's initial state handed
    in as (b, 1, h, p, n) from another graph)."""

    node: fx.Node
    dim: int

    def method(self):
        return "squeeze", (self.dim,)


@dataclasses.dataclass
class Match:
    family: str
    outputs: list[fx.Node]  # nodes whose uses take the op's outputs, in the op's output order
    target: Callable | None = None  # e.g. torch.ops.tk.rotary.default
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    reason: str | None = None  # recognised but kept, and why
    needs_grad: bool = False  # set by the matcher when any differentiable input requires grad
    has_backward_kernel: bool = True  # False: only replace in graphs that need no gradient, unless...
    # ...the op's reference autograd was measured faster than Inductor's compile of this spelling (the backward then
    # runs the reference; config.reference_backward forces the same for a whole family)
    reference_backward_faster: bool = False
    device: torch.device | None = None  # device of the inputs (from example values)
    # output index -> the op's dtype there, where the replaced code's output has another (an SSD computed in bf16
    # throughout returns a bf16 final state, the op an fp32 one; linear attention whose eager result is promoted to
    # fp32 by an fp32 parameter under autocast): the op's output is cast to the replaced dtype
    output_dtypes: dict[int, torch.dtype] = dataclasses.field(default_factory=dict)
    # True: the op's (first) output is the replaced output with dims 1 and 2 swapped (heads-first where the replaced
    # code was tokens-first, or the reverse); its uses get the transposed view back
    output_transposed: bool = False


# ---------------------------------------------------------------------------- helpers for matchers

def example(node: Any):
    """The example value Dynamo recorded for a node (a FakeTensor, a python scalar, ...)."""
    if isinstance(node, fx.Node):
        meta = node.meta
        return meta.get("example_value", meta.get("val"))
    return node


# ---------------------------------------------------------------------------- the report

@dataclasses.dataclass
class GraphReport:
    """What the rewrite did to one compiled graph."""

    replaced: Counter = dataclasses.field(default_factory=Counter)  # family -> count
    kept: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (family, reason)
    failed: str | None = None  # the rewrite raised; the graph went on unchanged

    def summary(self) -> str:
        if self.failed is not None:
            return f"tk_inductor: rewrite failed, graph passed through unchanged ({self.failed})"
        rep = ", ".join(f"{f}×{n}" for f, n in sorted(self.replaced.items())) or "nothing"
        kept = "; ".join(f"{f}: {r}" for f, r in self.kept)
        return f"tk_inductor: replaced {rep}" + (f"; kept {kept}" if kept else "")


@dataclasses.dataclass
class Report:
    """Everything compiled since the last `tk_inductor.reset()`."""

    graphs: list[GraphReport] = dataclasses.field(default_factory=list)

    @property
    def replaced(self) -> dict[str, int]:
        total: Counter = Counter()
        for g in self.graphs:
            total.update(g.replaced)
        return dict(total)

    @property
    def kept(self) -> list[tuple[str, str]]:
        return [k for g in self.graphs for k in g.kept]

    @property
    def failed(self) -> list[str]:
        return [g.failed for g in self.graphs if g.failed is not None]

    def __str__(self) -> str:
        return "\n".join(g.summary() for g in self.graphs) or "tk_inductor: no graphs compiled"


_report = Report()


def report() -> Report:
    """Aggregate over every graph compiled since `reset()` (a live object)."""
    return _report


def last_report() -> GraphReport | None:
    """The most recently compiled graph's report, or None."""
    return _report.graphs[-1] if _report.graphs else None


def reset() -> None:
    _report.graphs.clear()


def discard(graph_report: GraphReport) -> None:
    """Forget a graph's report (its compilation did not complete)."""
    for i, g in enumerate(_report.graphs):
        if g is graph_report:
            del _report.graphs[i]
            return


def _record(graph_report: GraphReport, cfg: Config) -> None:
    _report.graphs.append(graph_report)
    line = graph_report.summary()
    log.info("%s", line)
    if cfg.verbose:
        print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- failure policy

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    # Python's own "once" filter keys on the call site, and pytest or user
    # filters may reset it; keep our own set so each distinct reason shows once.
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------- the pass

def _family_finders() -> dict[str, Callable[[fx.Graph], Iterable[Match]]]:
    """`find` of every family whose matcher module exists (families land one by one)."""
    finders = {}
    for family in FAMILIES:
        name = f"tk_inductor.patterns.{family}"
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            continue
        finders[family] = importlib.import_module(name).find
    return finders


def _shared_reason(m: Match, cfg: Config) -> tuple[str | None, bool]:
    """(reason to keep, whether that reason is an environment failure to warn about)."""
    if m.family not in cfg.ops:
        return "not in the ops allowlist", False
    if m.needs_grad and not m.has_backward_kernel and not cfg.reference and not m.reference_backward_faster \
            and m.family not in cfg.reference_backward:
        return "training, and the op has no backward kernel yet", False
    if cfg.reference:
        return None, False
    if m.device is None or m.device.type != "cuda":
        return f"device {m.device} (kernels are CUDA-only; reference mode runs anywhere)", True
    capability = torch.cuda.get_device_capability(m.device)
    if capability != (9, 0):
        return f"GPU capability {capability} (kernels need sm_90)", True
    if not build.try_load(m.family):
        why = (build.failure(m.family) or "no sources").strip().splitlines()
        return f"kernel not built ({(why[0] if why else 'unknown')[:200]})", True
    return None, False


def _returns_tuple(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and len(schema.returns) > 1


def _carried_meta(node: fx.Node) -> dict:
    # The new node stands for `node`: later matchers read its example value,
    # and stack traces keep Inductor's provenance and error messages useful.
    return {k: v for k, v in node.meta.items() if k in ("example_value", "val", "stack_trace", "nn_module_stack")}


def _materialize_casts(graph: fx.Graph, value: Any, before: fx.Node) -> Any:
    """`value` with every Derived argument turned into its method's node, inserted before `before`."""
    if isinstance(value, Derived):
        name, args = value.method()
        with graph.inserting_before(before):
            derived = graph.call_method(name, (value.node, *args))
        src = example(value.node)
        if isinstance(src, torch.Tensor):
            derived.meta["example_value"] = getattr(src, name)(*args)
        return derived
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize_casts(graph, v, before) for v in value)
    if isinstance(value, dict):
        return {k: _materialize_casts(graph, v, before) for k, v in value.items()}
    return value


def _replace(graph: fx.Graph, m: Match, remap: dict[fx.Node, fx.Node]) -> list[fx.Node]:
    """Insert the op call and reroute the outputs' uses; returns the now-unused outputs.

    `remap` records old output -> new node, so a later match of the same
    family whose inputs were this match's outputs (layer i's residual feeding
    layer i+1's norm) is pointed at the new nodes."""
    # Insert after the last output so every input is defined; users that came
    # earlier are fixed by the topological sort at the end of the pass.
    order = {n: i for i, n in enumerate(graph.nodes)}
    present = [o for o in m.outputs if o is not None]
    last = max(present, key=order.__getitem__)
    with graph.inserting_after(last):
        call = graph.call_function(m.target, (), {})
    call.args = _materialize_casts(graph, tuple(m.args), call)
    call.kwargs = _materialize_casts(graph, dict(m.kwargs), call)
    examples = [example(o) if o is not None else None for o in m.outputs]
    values = [_op_value(e, m, i) for i, e in enumerate(examples)]  # the op's outputs
    if len(m.outputs) == 1 and not _returns_tuple(m.target):
        out = m.outputs[0]
        call.meta.update(_carried_meta(out))
        result = _back_to(graph, call, out, values[0], m, 0)
        out.replace_all_uses_with(result)
        remap[out] = result
        return present
    if all(e is not None for e in examples):
        call.meta["example_value"] = tuple(values)
    anchor = call
    for i, out in enumerate(m.outputs):
        if out is None:
            continue
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta.update(_carried_meta(out))
        anchor = _back_to(graph, item, out, values[i], m, i)
        out.replace_all_uses_with(anchor)
        remap[out] = anchor
    return present


def _op_value(replaced, m: Match, i: int):
    """The example value of the op's output i, from the replaced output's: in the op's layout (the first output, where
    it is transposed back) and dtype."""
    if not isinstance(replaced, torch.Tensor):
        return replaced
    if i == 0 and m.output_transposed:
        replaced = replaced.transpose(1, 2).contiguous()
    return replaced.to(m.output_dtypes[i]) if i in m.output_dtypes else replaced


def _back_to(graph: fx.Graph, node: fx.Node, out: fx.Node, value, m: Match, i: int) -> fx.Node:
    """`node`, the op's output i (example `value`), made what `out` was: dims 1 and 2 swapped back and cast to out's
    dtype where the match says so; the last node inserted (or node)."""
    if isinstance(value, torch.Tensor):
        node.meta["example_value"] = value
    if i == 0 and m.output_transposed:
        with graph.inserting_after(node):
            node = graph.call_method("transpose", (node, 1, 2))
        node.meta.update(_carried_meta(out))
        if isinstance(value, torch.Tensor):
            node.meta["example_value"] = value.transpose(1, 2)
    if i in m.output_dtypes and isinstance(example(out), torch.Tensor):
        with graph.inserting_after(node):
            node = graph.call_method("to", (node, example(out).dtype))
        node.meta.update(_carried_meta(out))
    return node


def _resolve(m: Match, remap: dict[fx.Node, fx.Node]) -> bool:
    """Point the match's inputs at replacements made before it; False if it overlaps one.

    An output that an earlier op already produces (two norms of one residual
    sum, as in GPT-NeoX's parallel residual) keeps that producer: it is the
    same FX value, so this op's copy of it is simply left unused."""
    outputs = [None if o in remap else o for o in m.outputs]
    if all(o is None for o in outputs):
        return False
    m.outputs = outputs

    def current(node: fx.Node) -> fx.Node:
        while node in remap:
            node = remap[node]
        return node

    def resolve(value):
        if isinstance(value, Derived):
            return dataclasses.replace(value, node=current(value.node))
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return current(value) if isinstance(value, fx.Node) else value

    m.args = resolve(tuple(m.args))
    m.kwargs = resolve(dict(m.kwargs))
    nodes = [o for o in m.outputs if o is not None]

    def collect(value):
        if isinstance(value, Derived):
            nodes.append(value.node)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, fx.Node):
            nodes.append(value)

    collect((m.args, m.kwargs))
    return not any(getattr(n, "_erased", False) for n in nodes)


def _removable(node: fx.Node) -> bool:
    if node.users or node.op not in ("call_function", "call_method", "call_module"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):  # in-place: a side effect on its input
        return False
    if "out" in node.kwargs:
        return False
    try:
        # A dead random op (dropout p=0 inside a replaced attention) only
        # consumes RNG state; dropping it is what Inductor does too.
        return not node.is_impure(impure_random=False)
    except TypeError:  # older torch without the keyword
        return not node.is_impure()


def _erase_dead(graph: fx.Graph, roots: list[fx.Node]) -> None:
    """Erase the replaced subgraphs: walk back from the rerouted outputs.

    A targeted walk rather than graph.eliminate_dead_code(), which would also
    drop unrelated in-place call_method nodes of the user's program."""
    work = list(roots)
    while work:
        node = work.pop()
        if getattr(node, "_erased", False) or node.graph is not graph or not _removable(node):
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        work.extend(inputs)


def _graph_modules(gm: fx.GraphModule, recurse: bool) -> list[fx.GraphModule]:
    """The graph and (for higher-order ops such as checkpoint) its subgraphs."""
    mods = [gm]
    if recurse:
        mods += [m for _, m in gm.named_modules() if isinstance(m, fx.GraphModule) and m is not gm]
    return mods


def run(gm: fx.GraphModule, cfg: Config, *, recurse: bool = True) -> tuple[GraphReport, list[str]]:
    """Rewrite `gm` in place for every family.

    Returns the report and the environment failures met (device, capability,
    kernel build), which `apply` turns into warnings or, in strict mode, an error.
    Exceptions from matchers propagate; `apply` restores the graph."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    from . import autocast

    graph_report = GraphReport()
    failures: list[str] = []
    finders = _family_finders()
    for mod in _graph_modules(gm, recurse):
        graph = mod.graph
        # Under autocast the matchers must see the dtype each op runs in (tk_inductor/autocast.py).
        changed = autocast.make_explicit(graph) > 0
        remap: dict[fx.Node, fx.Node] = {}
        for family, find in finders.items():
            for m in list(find(graph, cfg)):
                if m.family != family:
                    raise RewriteError(f"matcher of {family!r} returned a match for {m.family!r}")
                reason, is_failure = (m.reason, False) if m.reason else _shared_reason(m, cfg)
                if reason is not None:
                    graph_report.kept.append((family, reason))
                    if is_failure:
                        failures.append(f"{family}: {reason}")
                    continue
                if m.target is None:
                    raise RewriteError(f"{family} matcher returned a match without a target op")
                if not _resolve(m, remap):
                    graph_report.kept.append((family, "overlaps a subgraph replaced just before"))
                    continue
                dead = _replace(graph, m, remap)
                graph_report.replaced[family] += 1
                changed = True
                _erase_dead(graph, dead)
                # Sort before the next match, so matchers and lint see a valid
                # order (uses of early outputs may precede the new call).
                stable_topological_sort(graph)
        if changed:
            graph.lint()
            mod.recompile()
    return graph_report, failures


def _snapshot(graph: fx.Graph) -> fx.Graph:
    """A copy to restore on failure, node attributes included.

    Graph copies keep `meta` but not attributes set on nodes directly, such
    as Dynamo's `_dynamo_source` on placeholders, which AOTAutograd needs."""
    copied = fx.Graph(tracer_cls=graph._tracer_cls)
    node_map: dict[fx.Node, fx.Node] = {}
    output = copied.graph_copy(graph, node_map, return_output_node=True)
    copied._codegen = copy.deepcopy(graph._codegen)
    if output is not None:
        value, old_output = output
        new_output = copied.output(value, type_expr=getattr(old_output, "type", None))
        new_output.meta = copy.copy(old_output.meta)
        node_map[old_output] = new_output
    for old, new in node_map.items():
        for name, attr in vars(old).items():
            if name not in vars(new):
                setattr(new, name, attr)
    return copied


def apply(gm: fx.GraphModule, cfg: Config, *, recurse: bool = True) -> GraphReport:
    """`run` with the failure policy: the graph is either rewritten or left exactly as it was.

    Any exception from the rewrite warns once per distinct reason and leaves
    `gm` untouched; environment failures (no GPU, no compiler, failed kernel
    build) warn once and keep those subgraphs. `cfg.strict` raises instead."""
    saved: dict[fx.GraphModule, fx.Graph] = {}
    try:
        saved = {mod: _snapshot(mod.graph) for mod in _graph_modules(gm, recurse)}
        graph_report, failures = run(gm, cfg, recurse=recurse)
    except Exception as exc:
        for mod, graph in saved.items():  # empty if the snapshot itself failed: nothing changed yet
            mod.graph = graph
            mod.recompile()
        if cfg.strict:
            raise
        reason = f"{type(exc).__name__}: {exc}"
        _warn_once(f"tk_inductor: the rewrite failed and the graph is passed through unchanged: {reason}")
        log.debug("tk_inductor: rewrite failure", exc_info=True)
        graph_report = GraphReport(failed=reason)
        _record(graph_report, cfg)
        return graph_report
    if failures and cfg.strict:
        _record(graph_report, cfg)
        # The graph is already rewritten for what passed; strict wants the error.
        for mod, graph in saved.items():
            mod.graph = graph
            mod.recompile()
        raise RewriteError("tk_inductor (strict): " + "; ".join(dict.fromkeys(failures)))
    if failures:
        _warn_once(_failure_warning(failures))
    _record(graph_report, cfg)
    return graph_report


def _failure_warning(failures: list[str]) -> str:
    """One warning for a graph's environment failures ("family: reason"), the families grouped by reason.

    On a machine without a usable GPU every family fails for the same reason; one line says so."""
    by_reason: dict[str, list[str]] = {}
    for failure in failures:
        family, _, reason = failure.partition(": ")
        families = by_reason.setdefault(reason, [])
        if family not in families:
            families.append(family)
    parts = [f"{', '.join(families)}: {reason}" for reason, families in by_reason.items()]
    return f"tk_inductor: kept {'; '.join(parts)}; passing them through to the inner compiler"
