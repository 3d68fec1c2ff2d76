"""What this torch's Dynamo does with library calls that the matchers read through, and compiling with the rewrite
alone, graphs given fake CUDA example values (shared by the tests)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def einops_stays_one_op() -> bool:
    """Whether Dynamo puts an einops call in the graph as one node instead of tracing it into reshape/permute (torch
    2.11 does): the matchers read the torch ops, so einops spellings are matched only where it traces them."""
    import einops

    targets = []

    def capture(gm, example_inputs):
        targets.extend(getattr(n.target, "__module__", "") or "" for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: einops.rearrange(x, "b (c l) ... -> b c l ...", l=2), backend=capture)(torch.zeros(2, 4, 3))
    torch._dynamo.reset()
    return any(t.startswith("einops") for t in targets)


def rewritten(fn, inputs, options: dict, target, pick):
    """fn compiled with a backend that runs the rewrite (config `options`) on its Dynamo graph and runs that graph
    eagerly (autograd through the ops' registered backward): (the first graph's report, pick(node) for each call of
    `target` the rewrite inserted, fn's compiled output)."""
    from tk_inductor import config, rewrite

    cfg = config.current(options)
    reports, picked = [], []

    def backend(gm, example_inputs):
        reports.append(rewrite.run(gm, cfg)[0])
        picked.extend(pick(n) for n in gm.graph.nodes if n.target is target)
        return gm

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*inputs)
    return reports[0], picked, out


def to_fake_cuda(graph) -> None:
    """Every tensor example value becomes a fake CUDA tensor of the same shape, strides, dtype and requires_grad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def convert(v):
        if isinstance(v, torch.Tensor):
            with mode:
                t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="cuda")
            return t.requires_grad_(v.requires_grad) if v.is_floating_point() else t
        if isinstance(v, (tuple, list)):
            return type(v)(convert(x) for x in v)
        return v

    for node in graph.nodes:
        for key in ("example_value", "val"):
            if key in node.meta:
                node.meta[key] = convert(node.meta[key])
