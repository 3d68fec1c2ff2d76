"""The kernel build system (tk_inductor/build.py) on the CPU: CUDA toolkit detection, the cache key,
family listing, cache placement and extra (unit-test) folders. One test compiles a tiny library (the C++ runtime it
links); the rest compile nothing."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tk_inductor import build


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """A csrc tree with two families and a header, swapped in for the real one."""
    csrc = tmp_path / "csrc"
    (csrc / "include" / "tk").mkdir(parents=True)
    (csrc / "include" / "tk" / "tk.cuh").write_text("// tile library\n")
    for fam in ("alpha", "beta"):
        (csrc / "kernels" / fam).mkdir(parents=True)
        (csrc / "kernels" / fam / "k.cu").write_text(f"// {fam} kernel\n")
        (csrc / "kernels" / fam / "binding.cpp").write_text(f"// {fam} binding\n")
    (csrc / "kernels" / "empty").mkdir()  # no .cu: not a family
    (csrc / "kernels" / "empty" / "notes.txt").write_text("")
    monkeypatch.setattr(build, "CSRC", csrc)
    monkeypatch.setattr(build, "INCLUDE", csrc / "include")
    monkeypatch.setattr(build, "KERNELS", csrc / "kernels")
    monkeypatch.setenv("TK_INDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    return csrc


def test_families_lists_folders_with_cuda_sources(fake_tree):
    assert build.families() == ["alpha", "beta"]
    assert [p.name for p in build.sources("alpha")] == ["binding.cpp", "k.cu"]


def test_build_order_starts_listed_units_in_their_order(fake_tree):
    folder = fake_tree / "kernels" / "alpha"
    (folder / "a.cu").write_text("// another unit\n")
    (folder / "new.cu").write_text("// a unit the list does not name\n")
    (folder / "build_order").write_text("# slowest first\nk.cu\n\nbinding.cpp\na.cu\ngone.cu\n")
    assert [p.name for p in build.build_order("alpha")] == ["new.cu", "k.cu", "binding.cpp", "a.cu"]
    assert [p.name for p in build.build_order("beta")] == [p.name for p in build.sources("beta")]  # no list: by name


def test_real_build_orders_name_every_unit():
    for family in build.families():
        names = build.listed_units(family)
        if names is not None:
            assert sorted(names) == sorted(p.name for p in build.sources(family)), family


def test_real_tree_has_gemm_family():
    assert "gemm" in build.families()
    names = {p.name for p in build.sources("gemm")}
    assert {"gemm.cu", "binding.cpp"} <= names


def test_cache_key_follows_sources_and_headers(fake_tree):
    a0, b0 = build.source_hash("alpha"), build.source_hash("beta")
    assert a0 == build.source_hash("alpha")  # stable
    (fake_tree / "kernels" / "alpha" / "k.cu").write_text("// alpha kernel, edited\n")
    a1 = build.source_hash("alpha")
    assert a1 != a0 and build.source_hash("beta") == b0  # only the edited family changes
    (fake_tree / "kernels" / "alpha" / "extra.cuh").write_text("// family header\n")
    a2 = build.source_hash("alpha")
    assert a2 != a1
    (fake_tree / "include" / "tk" / "tk.cuh").write_text("// tile library, edited\n")
    assert build.source_hash("alpha") != a2 and build.source_hash("beta") != b0  # shared headers affect every family
    kv = build.kernel_version()
    (fake_tree / "kernels" / "beta" / "k.cu").write_text("// beta, edited\n")
    assert build.kernel_version() != kv


def test_cache_key_follows_flags(fake_tree, monkeypatch):
    h = build.source_hash("alpha")
    monkeypatch.setattr(build, "NVCC_FLAGS", [*build.NVCC_FLAGS, "-DSOMETHING"])
    assert build.source_hash("alpha") != h


def test_cache_dir_and_build_dir(fake_tree, tmp_path):
    assert build.cache_dir() == tmp_path / "cache"
    d = build.build_dir("alpha")
    assert d.parent == tmp_path / "cache" and d.name == f"alpha-{build.source_hash('alpha')}"
    assert not build.is_built("alpha") and not build.is_loaded("alpha")


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("TK_INDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / "tk_inductor"


def test_unknown_family_fails_cleanly(fake_tree):
    with pytest.raises(build.BuildError):
        build.load("no_such_family")
    assert build.try_load("no_such_family") is False
    assert "no kernel sources" in build.failure("no_such_family")
    build._failed.pop("no_such_family", None)


def test_load_folder_refuses_family_names_and_empty_folders(fake_tree, tmp_path):
    with pytest.raises(build.BuildError):
        build.load_folder("alpha", fake_tree / "kernels" / "alpha")
    with pytest.raises(build.BuildError):
        build.load_folder("nothing", tmp_path)


def test_extra_folder_is_hashed_but_not_a_family(fake_tree, tmp_path, monkeypatch):
    extra = tmp_path / "unit"
    extra.mkdir()
    (extra / "t.cu").write_text("// test kernel\n")
    monkeypatch.setitem(build._extra, "unit", extra)
    assert "unit" not in build.families()
    h = build.source_hash("unit")
    (extra / "t.cu").write_text("// test kernel, edited\n")
    assert build.source_hash("unit") != h


def _fake_toolkit(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    (root / "include" / "cuda.h").write_text("")
    return root


def test_cuda_home_from_environment(monkeypatch, tmp_path):
    toolkit = _fake_toolkit(tmp_path / "cuda-x")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    build.cuda_home.cache_clear()
    try:
        assert build.cuda_home() == str(toolkit.resolve())
    finally:
        build.cuda_home.cache_clear()


def test_cuda_home_sees_through_a_wrapper_script(monkeypatch, tmp_path):
    """nvcc on PATH may be a wrapper whose parent has no headers: follow the path it execs."""
    toolkit = _fake_toolkit(tmp_path / "real-cuda")
    wrapper_dir = tmp_path / "wrapper" / "bin"
    wrapper_dir.mkdir(parents=True)
    wrapper = wrapper_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {toolkit / "bin" / "nvcc"} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrapper_dir}{os.pathsep}{os.environ['PATH']}")
    build.cuda_home.cache_clear()
    try:
        assert build.cuda_home() == str(toolkit.resolve())
    finally:
        build.cuda_home.cache_clear()


def test_cuda_home_on_this_machine_has_headers():
    home = build.cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit installed")
    assert (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include" / "cuda.h").exists()


def test_cached_library_that_does_not_load_is_rebuilt(fake_tree, monkeypatch, capsys):
    """A cached library this machine cannot load (here: not an ELF file at all) is built again, not fatal."""
    from torch.utils import cpp_extension

    lib = build._library_path("alpha")
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not a shared library")
    calls = []

    def fake_load(name, build_directory, **kwargs):
        calls.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"rebuilt")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(build, "cuda_home", lambda: "/usr/local/cuda")
    try:
        assert build.load("alpha") == lib
    finally:
        build._loaded.pop("alpha", None)
    assert calls == ["tk_alpha"] and lib.read_bytes() == b"rebuilt"
    assert "does not load here" in capsys.readouterr().err


def test_build_runs_in_a_private_folder(fake_tree, monkeypatch):
    """A stale cpp_extension lock file in the cache folder (a killed build, or a folder copied mid-build) must not
    block the next build, and a failed build leaves no library behind."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(build, "cuda_home", lambda: "/nonexistent-cuda")
    out = build.build_dir("alpha")
    out.mkdir(parents=True)
    (out / "lock").write_text("")  # cpp_extension's FileBaton would wait on this forever
    seen = []

    def fake_load(name, build_directory, **kwargs):
        d = Path(build_directory)
        seen.append(d)
        assert d.parent == out and d != out and not (d / "lock").exists()
        if fail:
            raise RuntimeError("nvcc: error")
        (d / f"{name}.so").write_bytes(b"library")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failed", {})
    fail = True
    with pytest.raises(build.BuildError, match="nvcc: error"):
        build.load("alpha")
    assert not build.is_built("alpha") and not seen[-1].exists()
    fail = False
    assert build.load("alpha") == out / "tk_alpha.so"
    assert (out / "tk_alpha.so").read_bytes() == b"library" and not seen[-1].exists()
    assert sorted(p.name for p in out.iterdir()) == ["lock", "tk_alpha.so"]


def test_build_all_builds_families_side_by_side(fake_tree, monkeypatch):
    """build_all builds build_workers() families at a time (here both), reports each as it finishes, and keeps going
    past a family that fails."""
    import threading
    import time

    from torch.utils import cpp_extension

    monkeypatch.setattr(build, "cuda_home", lambda: "/nonexistent-cuda")
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failed", {})
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert build.build_workers(2) == 2 and build.build_workers(1) == 1
    running, most = set(), [0]
    guard = threading.Lock()

    def fake_load(name, build_directory, **kwargs):
        with guard:
            running.add(name)
            most[0] = max(most[0], len(running))
        time.sleep(0.3)
        with guard:
            running.discard(name)
        if name == "tk_beta":
            raise RuntimeError("nvcc: error in beta")
        (Path(build_directory) / f"{name}.so").write_bytes(b"library")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    done = []
    results = build.build_all(["alpha", "beta"], on_done=lambda f, err, s, cached: done.append((f, err is None, cached)))
    assert most[0] == 2, "the two families did not build at the same time"
    assert results["alpha"] is None and "nvcc: error in beta" in results["beta"]
    assert sorted(done) == [("alpha", True, False), ("beta", False, False)]
    assert build.is_built("alpha") and not build.is_built("beta")


def test_unloaded_kernels_warn_once_or_raise_under_strict(monkeypatch):
    """CUDA operands whose family's kernels do not load run the reference with one warning naming the family and
    the reason (the case of an Inductor cache hit, where the rewrite pass and its report never ran); strict raises."""
    import types
    import warnings

    from tk_inductor import config
    from tk_inductor.ops import _dispatch

    monkeypatch.setattr(build, "try_load", lambda family: False)
    monkeypatch.setattr(build, "failure", lambda family: "nvcc: no sm_90a support\nmore lines")
    monkeypatch.setattr(_dispatch, "_warned_unloaded", set())
    cuda = types.SimpleNamespace(is_cuda=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _dispatch.use_kernel("rotary", cuda, None) is False
        assert _dispatch.use_kernel("rotary", cuda) is False
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "rotary kernels did not load (nvcc: no sm_90a support)" in messages[0]
    with config.patch(strict=True), pytest.raises(RuntimeError, match="rotary kernels did not load"):
        _dispatch.use_kernel("rotary", cuda)
    assert _dispatch.use_kernel("rotary", types.SimpleNamespace(is_cuda=False)) is False  # CPU: the reference, quietly


THROWER_BINDING = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor boom(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 99, "boom: expected 99 dims, got ", x.dim());
  return x;
}
TORCH_LIBRARY_FRAGMENT(tk_thrower, m) { m.def("boom(Tensor x) -> Tensor"); m.impl("boom", c10::DispatchKey::CPU, &boom); }
"""

THROWER_CALL = """
import sys, torch
from tk_inductor import build
build.load_folder("thrower", sys.argv[1])
try:
    torch.ops.tk_thrower.boom(torch.zeros(2))
except RuntimeError as exc:
    print("raised:", str(exc).splitlines()[0])
"""


def test_binding_errors_raise_under_a_toolchain_that_links_libstdcxx_statically(tmp_path):
    """A g++ that links libstdc++ statically by default (as a wrapper that appends -static-libstdc++ does) must still
    give a library whose TORCH_CHECK raises a Python RuntimeError: with a private copy of the C++ runtime the throw
    killed the process (segmentation fault). The library is built and called in a child process."""
    if build.cuda_home() is None:
        pytest.skip("no CUDA toolkit installed")
    folder = tmp_path / "thrower"
    folder.mkdir()
    (folder / "kernel.cu").write_text("__global__ void nothing() {}\n")
    (folder / "binding.cpp").write_text(THROWER_BINDING)
    wrapper = tmp_path / "gxx-static"
    wrapper.write_text('#!/bin/sh\nexec g++ "$@" -static-libstdc++\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, CXX=str(wrapper), TK_INDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", THROWER_CALL, str(folder)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "raised: boom: expected 99 dims, got 1" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
