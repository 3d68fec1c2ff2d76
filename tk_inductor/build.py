"""JIT build of csrc/kernels/<family> with torch.utils.cpp_extension + ninja.

One shared library per family. Each holds torch-free `*.cu` kernel files and a
thin `binding.cpp` that registers raw CUDA ops in the `tk_cuda` namespace
(`TORCH_LIBRARY_FRAGMENT(tk_cuda, m)`); the user-facing `tk::` ops in
tk_inductor/ops call those. Builds are cached under a directory named by a
hash of the sources, flags and torch/CUDA versions, so an edit rebuilds and an
unchanged tree loads in well under a second.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("tk_inductor")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
INCLUDE = CSRC / "include"
KERNELS = CSRC / "kernels"

# No -lineinfo: the SASS is the same without it, and its line tables cost about 6% of a cold build (add it by hand for
# a source-level profile).
NVCC_FLAGS = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "-std=c++20",
    "-O3",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-DNDEBUG",
]
CXX_FLAGS = ["-O3", "-std=c++20", "-DNDEBUG"]
# The link names the C++ runtime this process already runs (cxx_runtime). Part of the cache key, so that libraries
# linked before this rule are rebuilt.
LINK_RULE = "libstdc++: the process's, shared"

_lock = threading.Lock()  # guards _family_locks
_family_locks: dict[str, threading.Lock] = {}  # one build at a time per family; families build side by side
_loaded: dict[str, Path] = {}
_failed: dict[str, str] = {}
_extra: dict[str, Path] = {}  # name -> folder built like a family but not one (see load_folder)


class BuildError(RuntimeError):
    pass


def families() -> list[str]:
    """Families that have kernel sources."""
    if not KERNELS.is_dir():
        return []
    return sorted(p.name for p in KERNELS.iterdir() if p.is_dir() and any(p.glob("*.cu")))


def _folder(family: str) -> Path:
    """A family's folder, or an extra folder registered with `load_folder` (unit-test kernels)."""
    return _extra.get(family, KERNELS / family)


def sources(family: str) -> list[Path]:
    folder = _folder(family)
    return sorted([*folder.glob("*.cu"), *folder.glob("*.cpp")])


def build_order(family: str) -> list[Path]:
    """The family's sources in the order the build starts them. Ninja starts units in the order it is given, and a
    family with more units than parallel jobs ends when its last-started unit does; so a folder with many units lists
    them slowest first in `build_order` (measured), which leaves short units for the end. Units the list does not name
    (new ones, of unknown cost) start first."""
    listed = listed_units(family)
    if listed is None:
        return sources(family)
    rank = {name: i for i, name in reversed(list(enumerate(listed)))}  # a repeated name keeps its first place
    return sorted(sources(family), key=lambda p: rank.get(p.name, -1))


def listed_units(family: str) -> list[str] | None:
    """The unit names a family's `build_order` file lists (comments and blank lines skipped); None without one."""
    path = _folder(family) / "build_order"
    if not path.exists():
        return None
    return [name for name in (line.strip() for line in path.read_text().splitlines())
            if name and not name.startswith("#")]


def _headers(family: str) -> list[Path]:
    folder = _folder(family)
    return sorted([*INCLUDE.rglob("*.cuh"), *INCLUDE.rglob("*.h"), *folder.glob("*.cuh"), *folder.glob("*.h")])


@functools.lru_cache(maxsize=None)
def cuda_home() -> str | None:
    """The real CUDA toolkit (the folder with bin/nvcc and include/cuda.h).

    `nvcc` on PATH may be a wrapper script, so torch's guess (two levels above
    it) can lack the headers; look through the usual places instead."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(str(real.parent.parent))
        try:  # a wrapper script: find the path it execs
            text = real.read_text(errors="ignore")[:4096]
            for word in text.split():
                if word.endswith("/bin/nvcc"):
                    candidates.append(str(Path(word).parent.parent))
        except OSError:
            pass
    candidates += ["/usr/local/cuda", *sorted(map(str, Path("/usr/local").glob("cuda-*")), reverse=True)]
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").exists() and (Path(c) / "include" / "cuda.h").exists():
            return str(Path(c).resolve())
    return None


def cxx_runtime() -> list[str]:
    """The shared libstdc++ this process has loaded (torch brings it), as a link input; [] where none is mapped.

    A library must throw through the same C++ runtime as torch: a binding's TORCH_CHECK raises a c10::Error that
    torch's dispatcher turns into a Python RuntimeError. Some toolchains link libstdc++ statically by default (an H200
    image's g++ did), which gives the library a private copy of the exception runtime, and the first error a kernel
    binding raised killed the process with a segmentation fault. Naming the process's libstdc++.so before the
    compiler's own libraries makes the linker take every C++ runtime symbol from it."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libstdc++.so") and os.path.exists(path):
                    return [path]
    except OSError:
        pass
    return []


def cache_dir() -> Path:
    root = os.environ.get("TK_INDUCTOR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tk_inductor"
    )
    return Path(root)


def source_hash(family: str) -> str:
    import torch

    h = hashlib.sha256()
    for path in [*sources(family), *_headers(family)]:
        h.update(os.path.relpath(path, CSRC.parent).encode())  # an extra folder may lie outside the repository
        h.update(path.read_bytes())
    h.update(" ".join(NVCC_FLAGS + CXX_FLAGS + [LINK_RULE]).encode())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def kernel_version() -> str:
    """Hash over every family's sources: part of the pre-grad pass uuid."""
    return hashlib.sha256("".join(source_hash(f) for f in families()).encode()).hexdigest()[:16]


def build_dir(family: str) -> Path:
    return cache_dir() / f"{family}-{source_hash(family)}"


def _library_path(family: str) -> Path:
    return build_dir(family) / f"tk_{family}.so"


def is_built(family: str) -> bool:
    """Built in the cache for the current sources (loaded or not)."""
    return family in _loaded or (family in families() and _library_path(family).exists())


def is_loaded(family: str) -> bool:
    return family in _loaded


def load(family: str, verbose: bool = False) -> Path:
    """Build (if needed) and load a family's library; raises BuildError on failure. Thread-safe: calls for one
    family wait for each other, calls for different families build in parallel (build_all)."""
    with _lock:
        family_lock = _family_locks.setdefault(family, threading.Lock())
    with family_lock:
        if family in _loaded:
            return _loaded[family]
        if family not in families() and family not in _extra:
            raise BuildError(f"no kernel sources for family {family!r} under {KERNELS}")
        import torch

        lib = _library_path(family)
        if lib.exists():  # cached: no toolkit lookup, no cpp_extension import (a cached load needs no nvcc)
            try:
                torch.ops.load_library(str(lib))
            except OSError as exc:
                # A library this machine cannot load (built elsewhere against another glibc or CUDA runtime, or
                # truncated): build it again from the sources rather than failing.
                print(f"tk_inductor: the cached {family} library does not load here ({str(exc)[:200]}); "
                      "rebuilding it", file=sys.stderr, flush=True)
                lib.unlink()
            else:
                _loaded[family] = lib
                return lib
        from torch.utils import cpp_extension

        home = cuda_home()
        if home is None:
            raise BuildError("no CUDA toolkit found (set CUDA_HOME to the folder holding bin/nvcc and include/cuda.h)")
        os.environ["CUDA_HOME"] = home
        cpp_extension.CUDA_HOME = home  # torch reads it once at import; the wrapper may have fooled it
        out = build_dir(family)
        out.mkdir(parents=True, exist_ok=True)
        # Each build runs in a private folder and moves the finished library into place with one rename: a build
        # that is killed (or a cache folder copied mid-build) leaves no half library and no cpp_extension lock
        # file, which would make every later build of the family wait on it forever.
        work = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=out))
        print(f"tk_inductor: building {family} kernels (first use; cached in {out}) ...", file=sys.stderr, flush=True)
        start = time.time()
        try:
            cpp_extension.load(
                name=f"tk_{family}",
                sources=[str(s) for s in build_order(family)],
                extra_include_paths=[str(INCLUDE), str(_folder(family))],
                extra_cflags=CXX_FLAGS,
                extra_cuda_cflags=NVCC_FLAGS,
                extra_ldflags=cxx_runtime(),
                build_directory=str(work),
                is_python_module=False,
                verbose=verbose,
            )
            os.replace(work / lib.name, lib)
        except Exception as exc:  # compiler errors arrive as RuntimeError/CalledProcessError
            _failed[family] = str(exc)
            raise BuildError(f"building {family} kernels failed: {exc}") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"tk_inductor: built {family} in {time.time() - start:.1f} s", file=sys.stderr, flush=True)
        _loaded[family] = lib
        return lib


def load_folder(name: str, folder: str | Path, verbose: bool = False) -> Path:
    """Build and load an extra folder of `.cu` / `.cpp` sources exactly like a family (same flags, cache
    and tk include path) without making it one: used for the unit-test kernels in tests/tile/csrc."""
    folder = Path(folder).resolve()
    if name in families() or not any(folder.glob("*.cu")):
        raise BuildError(f"{name!r} is a family name, or {folder} holds no .cu sources")
    _extra[name] = folder
    return load(name, verbose=verbose)


def try_load(family: str) -> bool:
    """Load if possible; never raises (a failed build is remembered and not retried)."""
    if family in _loaded:
        return True
    if family in _failed:
        return False
    try:
        load(family)
        return True
    except BuildError as exc:
        _failed[family] = str(exc)
        return False


def failure(family: str) -> str | None:
    return _failed.get(family)


def build_workers(count: int) -> int:
    """Families built side by side: each family's ninja already runs its sources in parallel, and a family has
    only a few (each ~10 s of one core), so a many-core machine builds several families at once: one per 4 cores
    (nvcc takes 1-2 GB a source)."""
    return max(1, min(count, (os.cpu_count() or 1) // 4))


def build_all(families_: list[str] | None = None, verbose: bool = False, on_done=None) -> dict[str, str | None]:
    """Build (and load) these families, every family by default, build_workers() of them at a time; returns
    family -> error (None when built). on_done(family, error, seconds, cached) is called as each one finishes."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    wanted = families() if families_ is None else list(families_)

    def one(family: str):
        start, cached = time.time(), is_built(family)
        try:
            load(family, verbose=verbose)
            return family, None, time.time() - start, cached
        except BuildError as exc:
            return family, str(exc), time.time() - start, cached

    results: dict[str, str | None] = {}
    with ThreadPoolExecutor(max_workers=build_workers(len(wanted))) as pool:
        for future in as_completed([pool.submit(one, f) for f in wanted]):
            family, error, seconds, cached = future.result()
            results[family] = error
            if on_done is not None:
                on_done(family, error, seconds, cached)
    return {f: results[f] for f in wanted}
