"""Every CUDA source (csrc/kernels/*/*.cu and the unit-test kernels in tests/tile/csrc) compiles for sm_90a
with the installed nvcc, torch-free (`-c`), warning-free: the CUDA code never breaks silently.
Skips only when no CUDA toolkit is found. Files compile in parallel, once per session."""
from __future__ import annotations

import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tk_inductor import build

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*build.KERNELS.glob("*/*.cu"), *(REPO / "tests" / "tile" / "csrc").glob("*.cu")])
FLAGS = build.NVCC_FLAGS  # the build's own


def _compile(src: Path, nvcc: str, out_dir: str) -> tuple[int, str]:
    cmd = [nvcc, *FLAGS, "-I", str(build.INCLUDE), "-I", str(src.parent), "-c", str(src),
           "-o", os.path.join(out_dir, src.parent.name + "_" + src.stem + ".o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def results() -> dict[Path, tuple[int, str]]:
    home = build.cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit (nvcc + cuda.h) found")
    nvcc = os.path.join(home, "bin", "nvcc")
    with tempfile.TemporaryDirectory() as out_dir, ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {src: pool.submit(_compile, src, nvcc, out_dir) for src in SOURCES}
        return {src: f.result() for src, f in futures.items()}


def test_sources_found():
    assert any(p.parent.name == "gemm" for p in SOURCES), "the gemm kernel sources are missing"
    assert (REPO / "tests" / "tile" / "csrc" / "tile_tests.cu") in SOURCES


@pytest.mark.parametrize("src", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_compiles_for_sm90a(results, src):
    rc, log = results[src]
    assert rc == 0, f"{src.relative_to(REPO)} does not compile:\n{log[-4000:]}"
    assert "warning" not in log.lower(), f"{src.relative_to(REPO)} compiles with warnings:\n{log[-4000:]}"
