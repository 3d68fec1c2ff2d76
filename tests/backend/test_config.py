"""Config resolution: defaults < environment < config.patch < options; allowlist parsing and errors."""
from __future__ import annotations

import dataclasses

import pytest

from tk_inductor import config
from tk_inductor.config import FAMILIES, Config


def test_defaults():
    cfg = config.current()
    assert cfg == Config()
    assert cfg.ops == FAMILIES
    assert (cfg.strict, cfg.reference, cfg.verbose, cfg.inner) == (False, False, False, "inductor")


def test_precedence_defaults_env_patch_options(monkeypatch):
    monkeypatch.setenv("TK_INDUCTOR_OPS", "attention,rotary")
    monkeypatch.setenv("TK_INDUCTOR_STRICT", "1")
    monkeypatch.setenv("TK_INDUCTOR_VERBOSE", "yes")
    env = config.current()
    assert env.ops == ("attention", "rotary") and env.strict and env.verbose and not env.reference

    with config.patch(ops=["layernorm"], reference=True) as patched:
        assert patched.ops == ("layernorm",) and patched.reference
        assert patched.strict  # from the environment, not patched
        cfg = config.current({"ops": "ssd", "strict": False})
        assert cfg.ops == ("ssd",) and not cfg.strict  # options beat patch and env
        assert cfg.reference and cfg.verbose  # untouched layers still apply
    assert config.current() == env  # patch undone


def test_env_false_values_override_nothing_set(monkeypatch):
    for value in ("0", "false", "No", "OFF"):
        monkeypatch.setenv("TK_INDUCTOR_REFERENCE", value)
        assert config.current().reference is False
    monkeypatch.setenv("TK_INDUCTOR_REFERENCE", "")
    assert config.current().reference is False  # empty means unset


def test_env_flag_typo_is_an_error(monkeypatch):
    monkeypatch.setenv("TK_INDUCTOR_STRICT", "ture")
    with pytest.raises(ValueError, match="TK_INDUCTOR_STRICT"):
        config.current()


def test_option_flag_types():
    assert config.current({"strict": 1}).strict is True
    assert config.current({"verbose": "off"}).verbose is False
    with pytest.raises(ValueError, match="strict"):
        config.current({"strict": "maybe"})
    with pytest.raises(ValueError):
        config.current({"reference": 2})


@pytest.mark.parametrize(
    "value, expected",
    [
        ("attention", ("attention",)),
        (" attention , rotary ", ("attention", "rotary")),
        ("rotary,attention,rotary", ("rotary", "attention")),
        (["ssd", "layernorm"], ("ssd", "layernorm")),
        (("linear_attention",), ("linear_attention",)),
        ("all", FAMILIES),
        ([], ()),
    ],
)
def test_allowlist_parsing(value, expected):
    assert config.current({"ops": value}).ops == expected


def test_allowlist_from_env(monkeypatch):
    monkeypatch.setenv("TK_INDUCTOR_OPS", "layernorm, attention")
    assert config.current().ops == ("layernorm", "attention")


def test_reference_backward_from_env_and_options(monkeypatch):
    assert config.current().reference_backward == ()
    monkeypatch.setenv("TK_INDUCTOR_REFERENCE_BACKWARD", "ssd, linear_attention")
    assert config.current().reference_backward == ("ssd", "linear_attention")
    assert config.current({"reference_backward": []}).reference_backward == ()
    with pytest.raises(ValueError, match="reference_backward: unknown op families"):
        config.current({"reference_backward": "mamba"})
    with pytest.raises(TypeError, match="reference_backward must be"):
        config.current({"reference_backward": 1})


def test_allowlist_unknown_family(monkeypatch):
    with pytest.raises(ValueError, match="flash"):
        config.current({"ops": ["attention", "flash"]})
    monkeypatch.setenv("TK_INDUCTOR_OPS", "attn")
    with pytest.raises(ValueError, match="attn"):
        config.current()


@pytest.mark.parametrize("value", [3, [1, 2], {"attention": True}, None])
def test_allowlist_bad_type(value):
    with pytest.raises(TypeError, match="ops"):
        config.current({"ops": value})


def test_unknown_option_and_inner():
    with pytest.raises(ValueError, match="refrence"):
        config.current({"refrence": True})
    with pytest.raises(ValueError, match="inner"):
        config.current({"inner": "eager"})
    assert config.current({"inner": "aot_eager"}).inner == "aot_eager"


def test_patch_validates_first_and_restores_on_error():
    with pytest.raises(ValueError):
        with config.patch(ops=["nope"]):
            pass
    assert config.current() == Config()
    with pytest.raises(KeyError):
        with config.patch(strict=True):
            assert config.current().strict
            raise KeyError("boom")
    assert config.current().strict is False


def test_patch_nests_and_decorates():
    with config.patch(ops=["rotary"]):
        with config.patch(strict=True):
            cfg = config.current()
            assert cfg.ops == ("rotary",) and cfg.strict
        assert config.current().ops == ("rotary",) and not config.current().strict

    @config.patch(reference=True)
    def inside():
        return config.current().reference

    assert inside() is True and config.current().reference is False


def test_key_is_stable_and_covers_every_field():
    base = Config()
    assert base.key() == Config().key()
    changed = {
        "ops": ("attention",),
        "reference_backward": ("ssd",),
        "strict": True,
        "reference": True,
        "verbose": True,
        "inner": "aot_eager",
    }
    assert set(changed) == {f.name for f in dataclasses.fields(Config)}
    keys = {base.replace(**{name: value}).key() for name, value in changed.items()}
    assert base.key() not in keys and len(keys) == len(changed)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().strict = True  # type: ignore[misc]


def test_package_exposes_config_lazily():
    import tk_inductor

    assert tk_inductor.config is config


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("true", True), ("0", False), ("false", False), ("off", False), ("", False), (None, False)])
def test_opt_in_variable(monkeypatch, value, on):
    from tk_inductor import _autoload

    if value is None:
        monkeypatch.delenv("TK_INDUCTOR", raising=False)
    else:
        monkeypatch.setenv("TK_INDUCTOR", value)
    assert _autoload.enabled() is on


@pytest.mark.parametrize("env", [None, "1", "0"])
@pytest.mark.parametrize("patched", [None, True, False])
def test_reference_at_run_time_matches_current(monkeypatch, env, patched):
    """The ops' cheap per-call check agrees with the full resolution."""
    if env is None:
        monkeypatch.delenv("TK_INDUCTOR_REFERENCE", raising=False)
    else:
        monkeypatch.setenv("TK_INDUCTOR_REFERENCE", env)
    changes = {} if patched is None else {"reference": patched}
    with config.patch(**changes):
        assert config.reference_at_run_time() == config.current().reference
