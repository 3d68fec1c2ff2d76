"""The post-grad pass (tk_inductor/post_grad.py) on the CPU, in reference mode: gradient sums folded into the
layernorm backward; no direct kernel calls without CUDA. The GPU half is in test_compiled_gpu.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tk_inductor
from tk_inductor import post_grad

from tolerance import summed

OPTS = {"reference": True}


def _norm_feeding(n: int, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
    r = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
    w = torch.randn(64, dtype=dtype, requires_grad=True)
    mats = [torch.randn(64, 32, dtype=dtype, requires_grad=True) for _ in range(n)]

    def f(x, r, w, *mats):
        h = x + r
        y = F.rms_norm(h, (64,), w, 1e-6)
        return sum((y @ m).sin() for m in mats[1:]) + (y @ mats[0]).cos(), h

    return f, (x, r, w, *mats)


def _compile_and_spy(f, inputs):
    from torch._inductor import config as inductor_config

    graphs = []
    with inductor_config.patch(post_grad_custom_post_pass=lambda g: graphs.append(g.python_code("self").src)):
        out, h = torch.compile(f, backend="thunderkittens", options=OPTS)(*inputs)
        grads = torch.autograd.grad(out.sum() + h.sum(), inputs)
    return graphs, grads


@pytest.mark.parametrize("n, folded", [(1, 0), (2, 1), (3, 2), (4, 2)])
def test_gradient_sums_fold_into_the_norm_backward(n, folded):
    f, inputs = _norm_feeding(n)
    graphs, grads = _compile_and_spy(f, inputs)
    assert tk_inductor.report().replaced.get("layernorm") == 1
    backward = graphs[-1]
    call = next(line for line in backward.splitlines() if "tk.layernorm_backward" in line)
    args = call[call.index("(") + 1:call.rindex(")")].split(", ")
    assert len(args) == 11 + folded, call  # dy2 (and dy3) appended; a fourth term stays an add in dy
    eager = torch.autograd.grad(sum(o.sum() for o in f(*inputs)), inputs)
    for a, e in zip(grads, eager):
        torch.testing.assert_close(a, e, **summed(e, 64 * n))


def test_gradient_sum_of_other_dtypes_is_not_folded():
    """A sum that promotes (bf16 + fp32) is not dy's dtype: it stays an add."""
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    b = graph.placeholder("b")
    a.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    b.meta["val"] = torch.empty(4, 8, dtype=torch.float32, device="meta")
    s = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
    s.meta["val"] = torch.empty(4, 8, dtype=torch.float32, device="meta")
    assert not post_grad._plain_sum(s, s.meta["val"])
    b.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    s.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    graph.output(s)
    assert post_grad._plain_sum(s, s.meta["val"])
    s2 = graph.call_function(torch.ops.aten.add.Tensor, (a, b), {"alpha": 2})
    s2.meta["val"] = s.meta["val"]
    assert not post_grad._plain_sum(s2, s.meta["val"])


def test_no_direct_calls_without_cuda():
    f, inputs = _norm_feeding(2)
    graphs, _ = _compile_and_spy(f, inputs)
    assert graphs and not any("tk_cuda" in g for g in graphs)


def test_the_pass_chains_and_is_installed_once():
    from torch._inductor import config as inductor_config

    calls = []
    user = lambda g: calls.append(g)  # noqa: E731
    ours = post_grad.make_pass(None, user)
    again = post_grad.make_pass(None, ours)  # wrapping ours again unwraps it
    assert again.chained is user
    assert ours.uuid() is None  # an uncacheable user pass stays uncacheable
    assert post_grad.make_pass(None, None).uuid().startswith("post-grad:")
    with inductor_config.patch(post_grad_custom_post_pass=None, pre_grad_custom_pass=None):
        from tk_inductor import backend

        backend.install_pre_grad_pass()
        first = inductor_config.post_grad_custom_post_pass
        backend.install_pre_grad_pass()
        assert inductor_config.post_grad_custom_post_pass is first and first._tk_inductor
