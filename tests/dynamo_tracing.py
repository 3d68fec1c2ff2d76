"""What this torch's Dynamo does with library calls that the matchers read through, and compiling with the rewrite
alone (shared by the tests)."""
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
