"""The post-grad pass: two rewrites of the graphs AOTAutograd hands Inductor, once the tk:: ops are in them.

1. `fold_gradient_sums`. A norm whose output feeds several matmuls (q/k/v, gate/up) gets its gradient as
   autograd's sum of theirs, `add(add(dq, dk), dv)`: elementwise kernels that read and write whole activations
   just before the norm's backward reads the sum again. Inductor fuses such a sum into its own norm backward; here
   the layernorm backward takes up to three gradients (dy, dy2, dy3) and sums them in fp32 as it loads them.
2. `call_kernels_directly`. A tk:: op is a Python custom op: its checks, its dispatch to the reference or the
   kernel, and torch's custom-op wrappers cost ~25-30 us of CPU per call, which a step of small graphs feels.
   Where the node's fake values show that the kernel runs (CUDA operands of dtypes it takes, the family built,
   reference mode off), the node calls `tk_cuda::<op>` instead: the same schema and semantics, registered in C++.
   The shapes and dtypes were checked when the graph was traced; the C++ op checks what it relies on again.

Runs as Inductor's `post_grad_custom_post_pass` (the backend sets it for its compiles; TK_INDUCTOR=1 installs it
beside the pre-grad pass), chained in front of any pass that was set before.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from . import config

aten = torch.ops.aten


def _bound(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def _set_args(node: fx.Node, bound: dict[str, Any]) -> None:
    """Positional arguments, without trailing ones at their defaults (as Inductor's layout constraints pass them)."""
    schema = node.target._schema.arguments
    args = [bound[a.name] for a in schema]
    while args and schema[len(args) - 1].has_default_value() and not isinstance(args[-1], fx.Node) \
            and args[-1] == schema[len(args) - 1].default_value:
        args.pop()
    node.args = tuple(args)
    node.kwargs = {}
    if "eager_input_vals" in node.meta:  # Inductor lays the inputs out as the op saw them when traced
        node.meta["eager_input_vals"] = (tuple(_val(a) for a in node.args), {})


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


# ---------------------------------------------------------------------------- 1. gradient sums

MAX_DY = 3  # dy, dy2, dy3


def _plain_sum(node: Any, like: torch.Tensor) -> bool:
    """`node` is `a + b` of two tensors of `like`'s shape and dtype (no broadcast, promotion or alpha), used once."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.add.Tensor):
        return False
    if len(node.users) != 1 or len(node.args) != 2 or node.kwargs:
        return False
    vals = [_val(a) for a in node.args]
    return all(isinstance(v, torch.Tensor) and v.dtype == like.dtype and v.shape == like.shape for v in vals)


def _terms(dy: fx.Node, like: torch.Tensor) -> list[fx.Node]:
    """dy as up to MAX_DY terms: the single-use adds that build it, opened from the outside in."""
    terms = [dy]
    while len(terms) < MAX_DY:
        i = next((i for i, t in enumerate(terms) if _plain_sum(t, like)), None)
        if i is None:
            break
        terms[i:i + 1] = list(terms[i].args)
    return terms


def fold_gradient_sums(graph: fx.Graph) -> int:
    """layernorm_backward(dy = a + b [+ c]) -> layernorm_backward(a, ..., dy2=b, dy3=c). Returns the count."""
    target = torch.ops.tk.layernorm_backward.default
    folded = 0
    for node in list(graph.find_nodes(op="call_function", target=target)):
        args = _bound(node)
        like = _val(args["dy"])
        if args["dy2"] is not None or not isinstance(like, torch.Tensor):
            continue
        terms = _terms(args["dy"], like)
        if len(terms) < 2:
            continue
        sums = [args["dy"]]
        args["dy"], args["dy2"], args["dy3"] = terms + [None] * (MAX_DY - len(terms))
        _set_args(node, args)
        while sums:  # the adds that built dy, now unused
            s = sums.pop()
            if isinstance(s, fx.Node) and not s.users and s.target is aten.add.Tensor:
                sums += [a for a in s.args if isinstance(a, fx.Node)]
                graph.erase_node(s)
        folded += 1
    return folded


# ---------------------------------------------------------------------------- 2. the CUDA ops directly

def _unit_last(t: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return t is None or (isinstance(t, torch.Tensor) and statically_known_true(t.stride(-1) == 1))


def _direct_ops() -> dict[Any, tuple[str, Callable, Callable[[dict], bool]]]:
    """tk op -> (raw op name, fake impl, whether the kernel runs for these (fake) arguments)."""
    from .ops import attention, layernorm, rotary

    table = {
        torch.ops.tk.attention.default: (
            "attention", attention._attention_fake,
            lambda a: a["causal"] is not None
            and attention.direct_kernel_ok(a["q"], a["k"], a["v"], scale=a["scale"], softcap=a["softcap"],
                                           dropout_p=a["dropout_p"])),
        torch.ops.tk.attention_backward.default: (
            "attention_backward", attention._attention_backward_fake,
            lambda a: a["causal"] is not None
            and attention.direct_kernel_ok(a["q"], a["k"], a["v"], a["grad_o"], a["o"], a["lse"], backward=True,
                                           scale=a["scale"], softcap=a["softcap"], dropout_p=a["dropout_p"])),
        torch.ops.tk.layernorm.default: (
            "layernorm", layernorm._forward_fake,
            # with dropout and no (seed, offset) the Python op draws them; the C++ op does not
            lambda a: (a["p"] == 0.0 or a["rng"] is not None)
            and layernorm.forward_kernel_ok(a["x"], a["residual"], a["weight"], a["bias"], a["out_dtype"], a["gate"])),
        torch.ops.tk.layernorm_backward.default: (
            "layernorm_backward", layernorm._backward_fake,
            lambda a: layernorm.backward_kernel_ok(a["dy"], a["dh"], a["h"], a["weight"], a["mean"], a["rstd"],
                                                   a["x_dtype"], a["dy2"], a["dy3"], a["gate"])),
        torch.ops.tk.rotary.default: (
            "rotary", rotary._fake,
            # q or k without a unit last stride: the Python op copies it and returns the layout its fake promised
            lambda a: _unit_last(a["q"]) and _unit_last(a["k"])
            and rotary.kernel_ok(a["q"], a["k"], a["cos"], a["sin"], rotary.output_dtype(a["q"], a["cos"], a["out_dtype"]))),
    }
    return table


_faked: set[str] = set()


def _raw_op(name: str, fake: Callable):
    """torch.ops.tk_cuda.<name>.default, with the tk op's fake impl (Inductor traces the node's outputs with it)."""
    if name not in _faked:
        torch.library.register_fake(f"tk_cuda::{name}", fake)
        _faked.add(name)
    return getattr(torch.ops.tk_cuda, name).default


def call_kernels_directly(graph: fx.Graph) -> int:
    """tk op nodes whose kernel runs -> the raw tk_cuda op. Returns the count."""
    from .ops import _dispatch

    if config.reference_at_run_time():
        return 0
    table = _direct_ops()
    count = 0
    for node in graph.nodes:
        entry = table.get(node.target) if node.op == "call_function" else None
        if entry is None:
            continue
        name, fake, runs = entry
        if not runs({k: _val(v) for k, v in _bound(node).items()}) or not _dispatch.has_kernel(name):
            continue
        node.target = _raw_op(name, fake)
        count += 1
    return count


# ---------------------------------------------------------------------------- the pass

def _make_pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ThunderKittensPostGradPass(CustomGraphPass):
        """fold_gradient_sums and call_kernels_directly, then the pass that was installed before (if any)."""

        def __init__(self, cfg: config.Config | None = None, chained=None):
            self.cfg = cfg  # the backend's; None: config.current() at each call (TK_INDUCTOR=1)
            self.chained = chained

        def __call__(self, graph: fx.Graph) -> None:
            cfg = self.cfg or config.current()
            fold_gradient_sums(graph)
            if not cfg.reference:
                call_kernels_directly(graph)
            if self.chained is not None:
                self.chained(graph)

        def uuid(self) -> str | None:
            from .backend import _import_ops, pass_uuid

            _import_ops()  # asked before the cache lookup: a hit runs code that calls the tk_cuda ops

            chained = None
            if self.chained is not None:
                chained = self.chained.uuid() if hasattr(self.chained, "uuid") else None
                if chained is None:
                    return None
            cfg = self.cfg or config.current()
            return f"post-grad:{pass_uuid()}:{cfg.key()}" + (f"+{chained}" if chained is not None else "")

    return ThunderKittensPostGradPass


_PASS_CLASS = None


def make_pass(cfg: config.Config | None = None, chained=None):
    global _PASS_CLASS
    if _PASS_CLASS is None:
        _PASS_CLASS = _make_pass_class()
    if getattr(chained, "_tk_inductor", False):  # ours already: replace it, never run twice
        chained = chained.chained
    instance = _PASS_CLASS(cfg, chained)
    instance._tk_inductor = True
    return instance
