"""The backend's plumbing, independent of the op families being written in parallel.

A stand-in family (labelled "rotary" so the allowlist knows it) replaces every
`sin` with a custom op `tktest::sine`; it exercises the rewrite, the report,
the failure policy, mode/options hand-off and both entry points. Tests of the
real families and models live in test_models.py and the family test files.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import tk_inductor
from tk_inductor import backend, rewrite
from tk_inductor.rewrite import Match

FAKE_FAMILY = "rotary"
CALLS = {"sine": 0}


@torch.library.custom_op("tktest::sine", mutates_args=())
def _sine(x: torch.Tensor) -> torch.Tensor:
    CALLS["sine"] += 1
    return torch.sin(x)


@_sine.register_fake
def _(x):
    return torch.empty_like(x)


def _sine_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _sine_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * torch.cos(x)


_sine.register_autograd(_sine_backward, setup_context=_sine_setup)


def find_sin(graph, cfg=None, *, has_backward_kernel=True):
    for node in graph.nodes:
        is_sin = (node.op == "call_function" and node.target in (torch.sin, torch.Tensor.sin)) or (
            node.op == "call_method" and node.target == "sin"
        )
        if not is_sin:
            continue
        x = rewrite.example(node.args[0])
        yield Match(
            FAKE_FAMILY,
            [node],
            torch.ops.tktest.sine.default,
            (node.args[0],),
            device=x.device,
            needs_grad=x.requires_grad,
            has_backward_kernel=has_backward_kernel,
        )


@pytest.fixture
def fake_family(monkeypatch):
    """Only the stand-in family runs (real matchers may or may not exist yet)."""
    monkeypatch.setattr(rewrite, "_family_finders", lambda: {FAKE_FAMILY: find_sin})
    CALLS["sine"] = 0
    return find_sin


def f(x):
    # A chain (the second sin's input is the first's output) and a method call.
    return torch.sin(torch.sin(x)) * 2 + (x * 3).sin().cos()


def _compile(fn, **options):
    return torch.compile(fn, backend="thunderkittens", options=options or None)


def _check_same(fn, compiled, shape=(4, 8)):
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = fn(x), compiled(x2)
    torch.testing.assert_close(y2, y, rtol=1e-6, atol=1e-6)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- rewrite + report


def test_replaces_and_matches_eager_aot_eager(fake_family):
    _check_same(f, _compile(f, reference=True, inner="aot_eager"))
    assert CALLS["sine"] == 3  # the custom op really ran, once per sin
    assert tk_inductor.report().replaced == {FAKE_FAMILY: 3}
    assert tk_inductor.report().kept == []


def test_replaces_and_matches_eager_through_inductor(fake_family):
    _check_same(f, _compile(f, reference=True))
    assert tk_inductor.last_report().replaced == {FAKE_FAMILY: 3}
    assert CALLS["sine"] == 3


def test_rewritten_graph_has_no_sin_left(fake_family, monkeypatch):
    seen = {}

    def capture(gm, example_inputs):
        seen["code"] = gm.code
        return gm.forward

    monkeypatch.setattr("torch._dynamo.backends.debugging.aot_eager", capture)
    _compile(f, reference=True, inner="aot_eager")(torch.randn(3))
    assert "tktest.sine" in seen["code"]
    assert "sin(" not in seen["code"].replace("sine", "")


def test_rewrites_inside_checkpointed_subgraphs(fake_family):
    """Activation checkpointing puts the layer in a higher-order op's subgraph."""

    def layer(y):
        return torch.sin(y) * 2

    def fn(x):
        return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) + 1

    _check_same(fn, _compile(fn, reference=True, inner="aot_eager"))
    assert tk_inductor.last_report().replaced == {FAKE_FAMILY: 1}
    assert CALLS["sine"] >= 1


def test_report_aggregates_and_resets(fake_family):
    _compile(f, reference=True, inner="aot_eager")(torch.randn(3))
    g = lambda x: torch.sin(x) + 1  # noqa: E731
    _compile(g, reference=True, ops=["attention"], inner="aot_eager")(torch.randn(3))
    rep = tk_inductor.report()
    assert len(rep.graphs) == 2
    assert rep.replaced == {FAKE_FAMILY: 3}
    assert rep.kept == [(FAKE_FAMILY, "not in the ops allowlist")]
    assert tk_inductor.last_report().kept == [(FAKE_FAMILY, "not in the ops allowlist")]
    assert str(rep).splitlines() == [
        f"tk_inductor: replaced {FAKE_FAMILY}×3",
        f"tk_inductor: replaced nothing; kept {FAKE_FAMILY}: not in the ops allowlist",
    ]
    tk_inductor.reset()
    assert tk_inductor.report().graphs == [] and tk_inductor.last_report() is None
    assert tk_inductor.report().replaced == {}


def test_allowlist_keeps_without_warning(fake_family, monkeypatch):
    monkeypatch.setenv("TK_INDUCTOR_OPS", "attention,ssd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_same(f, _compile(f, reference=True, inner="aot_eager"))
    assert CALLS["sine"] == 0
    assert tk_inductor.report().replaced == {}
    assert [k[1] for k in tk_inductor.report().kept] == ["not in the ops allowlist"] * 3


def test_training_without_backward_kernel_is_kept(monkeypatch):
    monkeypatch.setattr(rewrite, "_family_finders", lambda: {FAKE_FAMILY: lambda g, cfg: find_sin(g, has_backward_kernel=False)})
    fn = lambda x: torch.sin(x)  # noqa: E731
    # Reference mode has a reference backward, so it replaces.
    _compile(fn, reference=True, inner="aot_eager")(torch.randn(3, requires_grad=True))
    assert tk_inductor.last_report().replaced == {FAKE_FAMILY: 1}
    torch._dynamo.reset()
    # Kernel mode on CUDA would have no backward kernel: kept (checked before the device).
    _compile(fn, inner="aot_eager")(torch.randn(3, requires_grad=True))
    assert tk_inductor.last_report().kept == [(FAKE_FAMILY, "training, and the op has no backward kernel yet")]


def test_verbose_prints_one_line_per_graph(fake_family, capsys):
    def two_graphs(x):
        y = torch.sin(x)
        torch._dynamo.graph_break()
        return torch.sin(y) + 1

    _compile(two_graphs, reference=True, verbose=True, inner="aot_eager")(torch.randn(3))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tk_inductor:")]
    assert lines == [f"tk_inductor: replaced {FAKE_FAMILY}×1"] * 2


def test_verbose_from_env_and_quiet_by_default(fake_family, capsys, monkeypatch):
    _compile(f, reference=True, inner="aot_eager")(torch.randn(3))
    assert "tk_inductor:" not in capsys.readouterr().err
    torch._dynamo.reset()
    monkeypatch.setenv("TK_INDUCTOR_VERBOSE", "1")
    _compile(f, reference=True, inner="aot_eager")(torch.randn(3))
    assert f"tk_inductor: replaced {FAKE_FAMILY}×3" in capsys.readouterr().err


def test_logger(fake_family, caplog):
    with caplog.at_level(logging.INFO, logger="tk_inductor"):
        _compile(f, reference=True, inner="aot_eager")(torch.randn(3))
    assert any(r.name == "tk_inductor" and f"replaced {FAKE_FAMILY}×3" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- failure policy


def _broken_find(message):
    def find(graph, cfg):
        raise RuntimeError(message)

    return find


def test_matcher_exception_warns_once_and_passes_through(monkeypatch):
    def half_broken(graph, cfg):
        # Replace one sin first, then fail: the graph must come back untouched.
        yield from list(find_sin(graph))[:1]
        raise RuntimeError("matcher bug")

    monkeypatch.setattr(rewrite, "_family_finders", lambda: {FAKE_FAMILY: half_broken})
    CALLS["sine"] = 0
    with pytest.warns(RuntimeWarning, match="matcher bug") as record:
        _check_same(f, _compile(f, reference=True, inner="aot_eager"))
    assert len([w for w in record if "matcher bug" in str(w.message)]) == 1
    assert CALLS["sine"] == 0  # nothing of the half-done rewrite survived
    assert tk_inductor.last_report().failed == "RuntimeError: matcher bug"
    assert tk_inductor.last_report().replaced == {}
    assert "passed through unchanged" in tk_inductor.last_report().summary()

    # Same reason again: no second warning. A new reason: one new warning.
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        _compile(lambda x: torch.sin(x) - 1, reference=True, inner="aot_eager")(torch.randn(3))
    assert not [w for w in again if "matcher bug" in str(w.message)]
    monkeypatch.setattr(rewrite, "_family_finders", lambda: {FAKE_FAMILY: _broken_find("another bug")})
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="another bug"):
        _compile(lambda x: torch.sin(x) * 3, reference=True, inner="aot_eager")(torch.randn(3))
    assert len(tk_inductor.report().failed) == 3


def _inductor_fails(monkeypatch):
    import torch._inductor.compile_fx as cfx

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise TypeError("CantSplit.__init__() missing 2 required positional arguments")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    return calls


def test_identical_graph_skips_inductor_after_a_failure(fake_family, monkeypatch):
    calls = _inductor_fails(monkeypatch)
    _check_same(f, _compile(f, reference=True))
    torch._dynamo.reset()  # recompile the same graph: Inductor is not tried again
    _check_same(f, _compile(f, reference=True))
    assert len(calls) == 1
    torch._dynamo.reset()  # another input shape is another graph: tried
    _compile(f, reference=True)(torch.randn(5))
    assert len(calls) == 2


def test_inductor_failure_falls_back_to_aot_eager(fake_family, monkeypatch):
    _inductor_fails(monkeypatch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _check_same(f, _compile(f, reference=True))
    assert any("Inductor failed" in str(w.message) and "CantSplit" in str(w.message) for w in seen)
    assert tk_inductor.report().replaced == {FAKE_FAMILY: 3}
    assert CALLS["sine"] == 3  # the rewritten graph ran, without Inductor


def test_split_scans_turned_off_before_a_graph_with_a_scan(fake_family, monkeypatch):
    """A graph with a scan is compiled with split scans off (torch's split-scan codegen bug); one without is not."""
    import torch._inductor.compile_fx as cfx

    from tk_inductor import _compat

    turned_off = []
    monkeypatch.setattr(_compat, "disable_split_scans", lambda: turned_off.append(1) or True)
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, example_inputs, config_patches=None, **kw: gm.forward)
    _check_same(f, _compile(f, reference=True))
    assert not turned_off
    torch._dynamo.reset()
    g = lambda x: torch.cumsum(torch.sin(x), 1)  # noqa: E731
    _check_same(g, _compile(g, reference=True))
    assert turned_off


def test_inductor_failure_strict_raises(fake_family, monkeypatch):
    _inductor_fails(monkeypatch)
    with pytest.raises(Exception, match="CantSplit"):
        _compile(f, reference=True, strict=True)(torch.randn(3))


def test_strict_reraises_matcher_exception(monkeypatch):
    monkeypatch.setattr(rewrite, "_family_finders", lambda: {FAKE_FAMILY: _broken_find("matcher bug")})
    with pytest.raises(Exception, match="matcher bug"):
        _compile(f, reference=True, strict=True, inner="aot_eager")(torch.randn(3))
    monkeypatch.setenv("TK_INDUCTOR_STRICT", "1")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="matcher bug"):
        _compile(f, reference=True, inner="aot_eager")(torch.randn(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_no_gpu_warns_once_and_keeps(fake_family):
    with pytest.warns(RuntimeWarning, match="device cpu") as record:
        _check_same(f, _compile(f, inner="aot_eager"))
    assert len([w for w in record if "device cpu" in str(w.message)]) == 1  # three matches, one warning
    assert CALLS["sine"] == 0
    assert tk_inductor.report().kept == [(FAKE_FAMILY, "device cpu (kernels are CUDA-only; reference mode runs anywhere)")] * 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_no_gpu_strict_raises(fake_family):
    with pytest.raises(Exception, match="strict.*device cpu"):
        _compile(f, strict=True, inner="aot_eager")(torch.randn(3))


def test_kernel_build_failure_is_kept_with_reason(monkeypatch):
    """A family whose kernels fail to build keeps its subgraphs (one warning), others still run."""
    from tk_inductor import build

    def find_cuda_sin(graph, cfg):
        for m in find_sin(graph):
            m.device = torch.device("cuda", 0)  # as if the inputs were on an H100/H200
            yield m

    monkeypatch.setattr(rewrite, "_family_finders", lambda: {FAKE_FAMILY: find_cuda_sin})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(build, "try_load", lambda family: False)
    monkeypatch.setattr(build, "failure", lambda family: "nvcc: error: bad flag\nmore detail")
    with pytest.warns(RuntimeWarning, match="kernel not built"):
        _compile(f, inner="aot_eager")(torch.randn(3))
    assert tk_inductor.last_report().kept == [(FAKE_FAMILY, "kernel not built (nvcc: error: bad flag)")] * 3
    torch._dynamo.reset()
    with pytest.raises(Exception, match="kernel not built"):
        _compile(f, inner="aot_eager", strict=True)(torch.randn(3))


def test_bad_options_raise():
    with pytest.raises(Exception, match="refrence"):
        _compile(f, refrence=True)(torch.randn(3))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not_an_inductor_option"):
        _compile(f, not_an_inductor_option=1)(torch.randn(3))


# ---------------------------------------------------------------------------- mode / options hand-off


@pytest.fixture
def captured_patches(monkeypatch):
    """The Inductor config patches each compile gets, less our own post-grad pass (always set, chained in front of
    the user's: test_post_grad_pass_is_ours_and_chains_the_users)."""
    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        patches = dict(config_patches or {})
        ours = patches.pop("post_grad_custom_post_pass")
        assert getattr(ours, "_tk_inductor", False)
        seen.append(patches)
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    return seen


def test_post_grad_pass_is_ours_and_chains_the_users(monkeypatch):
    seen = []
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx",
                        lambda gm, ex, config_patches=None, **kw: seen.append(config_patches) or gm.forward)
    user = lambda graph: None  # noqa: E731
    torch.compile(f, backend="thunderkittens", options={"post_grad_custom_post_pass": user})(torch.randn(3))
    ours = seen[0]["post_grad_custom_post_pass"]
    assert ours._tk_inductor and ours.chained is user


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_mode_maps_like_inductor(captured_patches, mode):
    from torch._inductor import list_mode_options

    torch.compile(f, backend="thunderkittens", mode=mode)(torch.randn(3))
    assert captured_patches == [dict(list_mode_options(mode))]


def test_options_split_between_us_and_inductor(captured_patches, fake_family):
    _compile(f, reference=True, ops="rotary", max_autotune=True, **{"epilogue-fusion": False})(torch.randn(3))
    assert captured_patches == [{"max_autotune": True, "epilogue_fusion": False}]
    assert tk_inductor.last_report().replaced == {FAKE_FAMILY: 3}


def test_mode_inside_options(captured_patches):
    # torch.compile refuses mode= together with options=, so options may carry it.
    _compile(f, ops=["attention"], mode="max-autotune-no-cudagraphs")(torch.randn(3))
    assert captured_patches == [{"max_autotune": True, "coordinate_descent_tuning": True}]
    with pytest.raises(RuntimeError, match="mode or options"):
        torch.compile(f, backend="thunderkittens", mode="max-autotune", options={"ops": ["attention"]})


def test_unknown_mode(captured_patches):
    with pytest.raises(Exception, match="Unrecognized mode"):
        torch.compile(f, backend="thunderkittens", mode="fastest")(torch.randn(3))


def test_direct_call_signature(captured_patches, fake_family):
    """The backend is a plain function: (gm, example_inputs, *, mode, options)."""
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    out = backend.thunderkittens(gm, [torch.randn(2)], mode="max-autotune-no-cudagraphs", options={"ops": ["rotary"]})
    assert out(torch.ones(2)).tolist() == [2.0, 2.0]
    assert captured_patches[-1]["max_autotune"] is True
    with pytest.raises(TypeError, match="options must be a dict"):
        backend.thunderkittens(gm, [torch.randn(2)], options=["ops"])
    with pytest.raises(ValueError, match="mode given twice"):
        backend.thunderkittens(gm, [torch.randn(2)], mode="max-autotune", options={"mode": "reduce-overhead"})


# ---------------------------------------------------------------------------- pre-grad pass (TK_INDUCTOR=1)


def test_pre_grad_pass_uuid_tracks_config(monkeypatch):
    pass_cls = backend._make_pass_class()
    from torch._inductor.custom_graph_pass import CustomGraphPass

    p = pass_cls()
    assert isinstance(p, CustomGraphPass)
    first = p.uuid()
    assert first == p.uuid()
    monkeypatch.setenv("TK_INDUCTOR_OPS", "attention")
    assert p.uuid() != first
    monkeypatch.delenv("TK_INDUCTOR_OPS")
    assert p.uuid() == first


@pytest.fixture
def no_inductor_caches():
    """With the pre-grad pass, a cache hit skips it (that is the point of its uuid);
    tests that watch the pass run must not be served from an earlier run's cache.

    torch's config modules are patched with their own `patch()`, never `monkeypatch.setattr`: pytest >= 9.2 undoes
    a setattr on a module attribute by deleting it, which hides the option for the rest of the process."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def no_pre_grad_pass():
    """Inductor's pre_grad_custom_pass (and the post-grad pass installed beside it) unset for the test and restored
    after it."""
    with torch._inductor.config.patch(pre_grad_custom_pass=None, post_grad_custom_post_pass=None):
        yield


def test_pre_grad_pass_chains_a_user_pass(no_inductor_caches):
    from torch._inductor import config as inductor_config

    class UserPass:
        def __init__(self):
            self.calls = 0

        def __call__(self, graph):
            self.calls += 1

        def uuid(self):
            return "user-pass-v1"

    user = UserPass()
    with inductor_config.patch(pre_grad_custom_pass=user, post_grad_custom_post_pass=None):
        backend.install_pre_grad_pass()
        backend.install_pre_grad_pass()  # idempotent
        ours = inductor_config.pre_grad_custom_pass
        assert ours.chained is user and ours.uuid().endswith("+user-pass-v1")
        torch.compile(lambda x: x * 2)(torch.randn(3))
        assert user.calls == 1
        assert len(tk_inductor.report().graphs) == 1  # our pass ran on the graph too


def test_backend_does_not_rewrite_twice_with_pre_grad_pass(fake_family, no_inductor_caches, no_pre_grad_pass):
    backend.install_pre_grad_pass()
    _check_same(f, _compile(f, reference=True))
    assert len(tk_inductor.report().graphs) == 1
    assert tk_inductor.report().replaced == {FAKE_FAMILY: 3}


def test_pre_grad_pass_failure_passes_through(monkeypatch, no_inductor_caches, no_pre_grad_pass):
    def half_broken(graph, cfg):
        yield from list(find_sin(graph))[:1]
        raise RuntimeError("pre-grad matcher bug")

    monkeypatch.setattr(rewrite, "_family_finders", lambda: {FAKE_FAMILY: half_broken})
    monkeypatch.setenv("TK_INDUCTOR_REFERENCE", "1")
    CALLS["sine"] = 0
    backend.install_pre_grad_pass()
    with pytest.warns(RuntimeWarning, match="pre-grad matcher bug"):
        _check_same(f, torch.compile(f))
    assert CALLS["sine"] == 0
    assert tk_inductor.report().failed == ["RuntimeError: pre-grad matcher bug"]


# ---------------------------------------------------------------------------- fresh processes

_FAKE_FAMILY_SRC = textwrap.dedent(
    """
    import torch
    @torch.library.custom_op("tktest::sine", mutates_args=())
    def sine(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)
    sine.register_fake(lambda x: torch.empty_like(x))

    def install_fake_family():
        from tk_inductor import rewrite
        def find(graph, cfg):
            for n in graph.nodes:
                if n.op == "call_function" and n.target is torch.sin:
                    x = rewrite.example(n.args[0])
                    yield rewrite.Match("rotary", [n], torch.ops.tktest.sine.default, (n.args[0],), device=x.device)
        rewrite._family_finders = lambda: {"rotary": find}
    """
)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TK_INDUCTOR") or k == "TK_INDUCTOR_CACHE_DIR"}
    full_env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # see no_inductor_caches
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_entry_point_without_import():
    code = textwrap.dedent(
        """
        import sys, torch
        assert "tk_inductor.backend" not in sys.modules
        assert "thunderkittens" in torch._dynamo.list_backends()
        fn = torch.compile(lambda x: torch.relu(x) + 1, backend="thunderkittens", options={"inner": "aot_eager"})
        assert fn(torch.full((3,), -2.0)).tolist() == [1.0, 1.0, 1.0]
        assert "tk_inductor.backend" in sys.modules
        # The user also imports the package and the backend by name: no "duplicate name".
        import tk_inductor
        from tk_inductor import thunderkittens
        torch._dynamo.reset()
        fn = torch.compile(lambda x: x * 3, backend="thunderkittens")
        assert fn(torch.ones(2)).tolist() == [3.0, 3.0]
        fn = torch.compile(lambda x: x * 4, backend=thunderkittens)
        assert fn(torch.ones(2)).tolist() == [4.0, 4.0]
        print(len(tk_inductor.report().graphs))
        """
    )
    assert _run(code).stdout.split() == ["3"]


_OPT_IN_CODE = _FAKE_FAMILY_SRC + textwrap.dedent(
    """
    import torch._inductor.config as inductor_config
    import tk_inductor
    install_fake_family()
    fn = torch.compile(lambda x: torch.sin(x) + 1)   # the default backend, unchanged script
    x = torch.randn(5)
    torch.testing.assert_close(fn(x), torch.sin(x) + 1)
    print(type(inductor_config.pre_grad_custom_pass).__name__, tk_inductor.report().replaced)
    """
)


def test_opt_in_env_rewrites_default_compile():
    out = _run(_OPT_IN_CODE, TK_INDUCTOR="1", TK_INDUCTOR_REFERENCE="1").stdout.strip().splitlines()[-1]
    assert out == "ThunderKittensPreGradPass {'rotary': 1}"


def test_without_opt_in_default_compile_is_untouched():
    out = _run(_OPT_IN_CODE).stdout.strip().splitlines()[-1]
    assert out == "NoneType {}"


def test_opt_in_is_lazy_and_import_is_cheap():
    code = textwrap.dedent(
        """
        import sys
        import tk_inductor
        assert "torch" not in sys.modules, "import tk_inductor must not import torch"
        import torch
        assert "torch._inductor" not in sys.modules and "tk_inductor.backend" not in sys.modules
        import torch._inductor.config as c
        print(type(c.pre_grad_custom_pass).__name__)
        """
    )
    assert _run(code, TK_INDUCTOR="1").stdout.split() == ["ThunderKittensPreGradPass"]


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("tk_inductor.patterns.attention") is None,
    reason="patterns/attention.py has not landed yet",
)
def test_opt_in_env_with_real_attention_family():
    code = textwrap.dedent(
        """
        import torch, torch.nn.functional as F, tk_inductor
        class M(torch.nn.Module):
            def forward(self, q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2
        m, q = M(), torch.randn(1, 2, 16, 64)
        out = torch.compile(m)(q, q, q)
        torch.testing.assert_close(out, m(q, q, q), rtol=1e-5, atol=1e-5)
        print(tk_inductor.report().replaced.get("attention", 0))
        """
    )
    assert _run(code, TK_INDUCTOR="1", TK_INDUCTOR_REFERENCE="1").stdout.split()[-1] == "1"


# ---------------------------------------------------------------------------- CLI


def test_cli_doctor():
    proc = _run("from tk_inductor.__main__ import main; raise SystemExit(main(['doctor']))")
    for field in ("torch", "gpu", "CUDA_HOME", "cache dir", "config"):
        assert field in proc.stdout
    config_line = next(line for line in proc.stdout.splitlines() if line.startswith("config"))
    for option in ("ops=", "reference_backward=", "strict=", "reference=", "inner="):
        assert option in config_line  # every option, as resolved
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        assert "kernel linear_attention " in proc.stdout  # the longest family name keeps its column
    else:  # nothing to build where no kernel can run
        assert "no build needed" in proc.stdout and "not built" not in proc.stdout


@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_cli_demo_on_cpu(precision):
    """The README's second command: the built-in model through the rewrite, checked against eager (under CPU
    autocast with fp32 parameters too)."""
    proc = _run(f"from tk_inductor.__main__ import main; raise SystemExit(main(['demo', '--cpu', '--precision', "
                f"'{precision}']))")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replaced attention×2, layernorm×5, rotary×2" in proc.stdout
    assert "outputs and gradients equal eager" in proc.stdout


def test_cli_build_unknown_family_fails():
    from tk_inductor.__main__ import main

    assert main(["build", "--families", "no_such_family"]) == 1
