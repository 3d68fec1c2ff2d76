"""Make autocast's casts explicit in a Dynamo (torch-IR) graph, so the matchers see the dtype each op runs in.

Under `torch.autocast` an op on autocast's lists casts its floating inputs itself: matmul-like ops and SDPA to the
autocast dtype, softmax, norms, reductions and the fp32 pointwise list to fp32, cat/stack to the widest input.
Dynamo's graph keeps the user's spelling, without those casts, while its example values carry autocast's result
dtypes (`linear` of fp32 operands gives bf16). This pass inserts `x.to(dtype)` on every input that autocast casts,
at the nodes where it did: inside a region where autocast is on for the inputs' device (the ambient state at compile
time, which Dynamo guards, and the graph's own `_enter_autocast`/`_exit_autocast` pairs), for an op of autocast's
lists, read off the example values (which lists an op is on differs between CUDA and CPU; the values say what ran).

The inserted casts are the casts autocast makes, so the graph computes the same values with autocast around it or
not, and the matchers prove and replace subgraphs under autocast exactly as in one precision. The `tk::` ops are on
no autocast list: autocast passes their inputs through, so the explicit casts are what reaches them. A value cast
to one dtype for several users (a norm's output feeding q, k and v projections, a weight in every layer of a loop)
gets one cast node, as autocast's cast cache does for parameters.

Why here and not after AOTAutograd, where autocast is already explicit: the rewrite runs on the torch-IR graph so
that replaced ops carry their own backward into AOTAutograd; matching the aten joint graph instead would mean a
second set of matchers over forward and backward graphs (DESIGN.md §2).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .rewrite import example

# Marks the cast nodes this pass inserts (node.meta): a matcher of an op whose precision is its own (fp32
# accumulation) may look through them.
AUTOCAST_CAST = "tk_autocast_cast"

_LOW = (torch.float16, torch.bfloat16)
_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)  # autocast leaves fp64 alone


def _functions(*names: str) -> set:
    found = set()
    for name in names:
        module, _, attr = name.rpartition(".")
        obj = {"torch": torch, "F": F, "operator": operator}[module]
        if hasattr(obj, attr):
            found.add(getattr(obj, attr))
    return found


# Ops autocast runs in its low dtype (CUDA and CPU lists), ...
_LOW_FUNCTIONS = _functions(
    "torch.matmul", "operator.matmul", "torch.mm", "torch.bmm", "torch.baddbmm", "torch.addmm", "torch.addbmm",
    "torch.mv", "torch.einsum", "torch.chain_matmul", "F.linear", "F.scaled_dot_product_attention", "F.conv1d",
    "F.conv2d", "F.conv3d", "F.bilinear",
)
_LOW_METHODS = {"matmul", "__matmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "mv"}
# ... in fp32 (CUDA's fp32 and set-dtype lists; on CPU several of them run in the input dtype, which the example
# values show) ...
_FP32_FUNCTIONS = _functions(
    "F.softmax", "torch.softmax", "F.log_softmax", "torch.log_softmax", "F.layer_norm", "torch.layer_norm",
    "F.rms_norm", "torch.rms_norm", "F.group_norm", "torch.group_norm", "torch.exp", "torch.expm1", "torch.log",
    "torch.log1p", "torch.log2", "torch.log10", "torch.rsqrt", "torch.reciprocal", "torch.pow", "operator.pow",
    "torch.acos", "torch.asin", "torch.cosh", "torch.sinh", "torch.tan", "torch.erfinv", "F.softplus", "torch.sum",
    "torch.cumsum", "torch.prod", "torch.cumprod", "torch.logsumexp", "torch.norm", "torch.dist", "torch.cdist",
    "F.cosine_similarity", "F.cross_entropy", "F.nll_loss", "F.mse_loss", "F.l1_loss", "F.smooth_l1_loss",
    "F.kl_div", "F.binary_cross_entropy_with_logits",
)
_FP32_METHODS = {"softmax", "log_softmax", "exp", "expm1", "log", "log1p", "log2", "log10", "rsqrt", "reciprocal",
                 "pow", "__pow__", "sum", "cumsum", "prod", "cumprod", "logsumexp", "norm"}
# ... or in the widest of its inputs' dtypes.
_PROMOTE_FUNCTIONS = _functions("torch.cat", "torch.concat", "torch.concatenate", "torch.stack", "torch.addcmul",
                                "torch.addcdiv", "torch.atan2", "torch.cross", "torch.dot", "torch.vdot",
                                "torch.tensordot")
_PROMOTE_METHODS = {"addcmul", "addcdiv", "atan2", "cross", "dot", "vdot"}

def _autocast_markers():
    """(enter, exit) functions Dynamo records for `with torch.autocast(...)` inside a compiled region."""
    from torch.amp import autocast_mode

    return getattr(autocast_mode, "_enter_autocast", None), getattr(autocast_mode, "_exit_autocast", None)


def _category(node: fx.Node) -> str | None:
    if node.op == "call_function":
        target = node.target
        if target in _LOW_FUNCTIONS:
            return "low"
        if target in _FP32_FUNCTIONS:
            return "fp32"
        if target in _PROMOTE_FUNCTIONS:
            return "promote"
    elif node.op == "call_method":
        if node.target in _LOW_METHODS:
            return "low"
        if node.target in _FP32_METHODS:
            return "fp32"
        if node.target in _PROMOTE_METHODS:
            return "promote"
    return None


def ambient() -> dict[str, bool]:
    """Whether autocast is on, per device type, where the backend is called (inside the user's autocast context)."""
    state = {}
    for device_type in ("cuda", "cpu"):
        try:
            state[device_type] = bool(torch.is_autocast_enabled(device_type))
        except (TypeError, RuntimeError):
            state[device_type] = False
    return state


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.map_arg((node.args, node.kwargs), found.append)
    return [n for n in found if isinstance(example(n), torch.Tensor)]


def _casts_needed(node: fx.Node, category: str, enabled: dict[str, bool]) -> tuple[torch.dtype, list[fx.Node]] | None:
    """(dtype, the inputs autocast cast to it) for one node, or None."""
    out = example(node)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    dtype = out.dtype
    if (category == "low" and dtype not in _LOW) or (category == "fp32" and dtype != torch.float32):
        return None
    inputs = [n for n in _tensor_inputs(node) if example(n).is_floating_point()]
    if not inputs or not enabled.get(out.device.type, False):
        return None
    if any(example(n).dtype == torch.float64 for n in inputs):  # autocast casts no fp64 operand: keep it exact
        return None
    cast = [n for n in inputs if example(n).dtype != dtype and example(n).dtype in _ELIGIBLE
            and example(n).device.type == out.device.type]
    return (dtype, cast) if cast else None


def _mutates(node: fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or "out" in node.kwargs


def make_explicit(graph: fx.Graph, enabled: dict[str, bool] | None = None) -> int:
    """Insert autocast's casts into `graph` (in place); returns how many cast nodes were added."""
    enter, exit_ = _autocast_markers()
    stack = [dict(ambient() if enabled is None else enabled)]
    casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    added = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and enter is not None and node.target is enter:
            device_type, _dtype, on = (list(node.args) + [None, None, True])[:3]
            state = dict(stack[-1])
            if isinstance(device_type, str) and isinstance(on, bool):
                state[device_type] = on
            stack.append(state)
            continue
        if node.op == "call_function" and exit_ is not None and node.target is exit_:
            if len(stack) > 1:
                stack.pop()
            continue
        if _mutates(node):  # a cast made before an in-place update must not stand for the value after it
            for key in [k for k in casts if k[0] in node.all_input_nodes]:
                del casts[key]
        category = _category(node)
        if category is None or not any(stack[-1].values()):
            continue
        needed = _casts_needed(node, category, stack[-1])
        if needed is None:
            continue
        dtype, inputs = needed
        for inp in inputs:
            key = (inp, dtype)
            if key not in casts:
                with graph.inserting_before(node):
                    cast = graph.call_method("to", (inp, dtype))
                cast.meta["example_value"] = example(inp).to(dtype)
                cast.meta[AUTOCAST_CAST] = True
                for k in ("stack_trace", "nn_module_stack"):
                    if k in node.meta:
                        cast.meta[k] = node.meta[k]
                casts[key] = cast
                added += 1
            node.replace_input_with(inp, casts[key])
    return added
