"""GPU tests of compiled graphs with the norm and rotary kernels: the post-grad pass calls the CUDA ops directly, and
tiny HF models compiled with them equal eager."""
from __future__ import annotations

import pytest
import torch

import tk_inductor
from kernel_checks import rel_err
from tk_inductor import build

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    for family in ("layernorm", "rotary"):
        build.load(family)


def test_compiled_norm_and_rotary_call_the_cuda_ops(monkeypatch):
    """The post-grad pass points the compiled graphs at tk_cuda:: (no Python per call) and folds the gradient sum
    of a norm feeding two matmuls into its backward; results match eager autocast."""
    from torch._inductor import config as inductor_config

    seen = []

    def spy(graph):
        seen.append({str(n.target) for n in graph.nodes if n.op == "call_function"})

    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(4, 256, 512, generator=g, device="cuda").bfloat16().requires_grad_()
    r = torch.randn(4, 256, 512, generator=g, device="cuda").requires_grad_()
    w = torch.randn(512, generator=g, device="cuda").requires_grad_()
    a, b = (torch.randn(512, 512, generator=g, device="cuda").requires_grad_() for _ in range(2))
    cos, sin = torch.randn(256, 64, device="cuda"), torch.randn(256, 64, device="cuda")

    def f(x, r, w, a, b):
        h = r + x
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        y = w * v.to(h.dtype)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q = (y @ a).view(4, 256, 8, 64).transpose(1, 2)
            q = q * cos + torch.cat((-q[..., 32:], q[..., :32]), -1) * sin
            return q, y @ b, h

    with inductor_config.patch(post_grad_custom_post_pass=spy):
        compiled = torch.compile(f, backend="thunderkittens")
        outs = compiled(x, r, w, a, b)
        grads = torch.autograd.grad([o.float().sum() for o in outs], (x, r, w, a, b))
    report = str(tk_inductor.report())
    assert "layernorm" in report and "rotary" in report, report
    forward, backward = seen[0], seen[-1]
    assert "tk_cuda.layernorm.default" in forward and "tk_cuda.rotary.default" in forward, forward
    assert "tk_cuda.layernorm_backward.default" in backward and "tk.layernorm_backward.default" not in backward
    eager = f(x, r, w, a, b)
    ref = torch.autograd.grad([o.float().sum() for o in eager], (x, r, w, a, b))
    for o, e in zip(outs, eager):
        assert o.dtype == e.dtype and rel_err(o, e) < 2e-2
    for gr, e in zip(grads, ref):
        assert gr.dtype == e.dtype and rel_err(gr, e) < 2e-2


def test_tiny_models_compiled_equal_eager():
    transformers = pytest.importorskip("transformers")
    # the matchers live in patterns/, importable as tk_inductor.patterns once the package is installed
    pytest.importorskip("tk_inductor.patterns", reason="tk_inductor not installed (pip install -e .)")
    import tk_inductor

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=512, vocab_size=256, max_position_embeddings=256)
    gpt = transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    for model, families in ((transformers.LlamaModel(cfg), ("layernorm", "rotary")), (transformers.GPT2Model(gpt), ("layernorm",))):
        model = model.cuda().float()
        ids = torch.randint(0, 256, (2, 100), device="cuda")
        tk_inductor.reset()
        torch._dynamo.reset()
        # the backend function itself: works whether or not the package's entry points are installed
        c = torch.compile(model, backend=tk_inductor.thunderkittens, options={"ops": ["layernorm", "rotary"], "inner": "aot_eager"})
        out = c(input_ids=ids).last_hidden_state
        ref = model(input_ids=ids).last_hidden_state
        assert rel_err(out, ref) < 1e-4
        rep = tk_inductor.report()
        for f in families:
            assert rep.replaced.get(f), str(rep)
        params = [p for p in model.parameters() if p.requires_grad]
        w = torch.randn_like(out)
        ga = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
        gb = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
        for a, b in zip(ga, gb):
            if a is not None and b is not None and b.norm() > 0:
                assert rel_err(a, b) < 1e-3
