"""GPU unit tests of the tile library (csrc/include/tk) through the test kernels in tests/tile/csrc,
and of the LCSF GEMM (tk::gemm), each against PyTorch on random data with odd tile counts and tails."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]
R, C = 32, 48  # the register tile of the tile_op kernel: 2 x 3 base tiles
REG_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}


@pytest.fixture(scope="module")
def lib():
    from tk_inductor import build

    build.load_folder("tile_tests", REPO / "tests" / "tile" / "csrc")
    return torch.ops.tk_tile_tests


def _tol(reg):
    return {0: (1e-5, 1e-5), 1: (3e-2, 3e-2), 2: (4e-3, 4e-3)}[reg]


# ---------------------------------------------------------------- register ops (one warp)

TILE_OPS = {  # op code -> reference on the zero-padded 32 x 48 inputs (the kernel reads zeros past the edge)
    0: lambda x, y: x,
    1: lambda x, y: torch.exp2(x),
    2: lambda x, y: x * y,
    3: lambda x, y: x + 1.5,
    4: lambda x, y: torch.maximum(x, y),
    5: lambda x, y: x - x.amax(1, keepdim=True),
    6: lambda x, y: x / x.sum(0, keepdim=True),
    7: lambda x, y: x * y.sum(1, keepdim=True),
    8: lambda x, y: x + y.amax(0, keepdim=True),
    9: lambda x, y: x,  # shared round trip, 48 wide
    10: lambda x, y: x,  # shared round trip at a column offset, 64 wide
    11: lambda x, y: x,  # swap_layout
    12: lambda x, y: x.t(),  # transpose
    13: lambda x, y: x.t(),  # transpose_sep
    14: lambda x, y: x.bfloat16().float(),
    15: lambda x, y: torch.exp2(x - torch.maximum(x.amax(1, keepdim=True), y.amax(1, keepdim=True))),
    16: lambda x, y: x * torch.exp(x.amax(1, keepdim=True) - y.sum(1, keepdim=True)),
    17: lambda x, y: x.amax(1, keepdim=True).expand_as(x),
    18: lambda x, y: _lower_or_row_mark(x),  # map_indexed
    19: lambda x, y: _broadcast_products(x),  # column_at, row_pair_at (16-bit row layout only)
}


def _broadcast_products(x):
    """Per 16 x 16 base tile: d(r, c) = x(r, 5) * x(11, c), in the tile's coordinates."""
    t = x.reshape(R // 16, 16, C // 16, 16)
    return (t[:, :, :, 5:6] * t[:, 11:12, :, :]).reshape(R, C)


def _lower_or_row_mark(x):
    r = torch.arange(x.shape[0], device=x.device)[:, None]
    c = torch.arange(x.shape[1], device=x.device)[None, :]
    return torch.where(c <= r, x, -0.5 * (r % 3).to(x.dtype))
VEC_OPS = {
    20: lambda x: x.amax(1),
    21: lambda x: x.sum(1),
    22: lambda x: x.amax(0),
    23: lambda x: x.sum(0),
    24: lambda x: x.amin(1),
}


def _inputs(rows, cols, op, reg):
    g = torch.Generator(device="cuda").manual_seed(1000 * op + 10 * rows + cols)
    x = torch.randn(rows, cols, device="cuda", generator=g)
    y = torch.randn(rows, cols, device="cuda", generator=g)
    if op == 6:
        x = x.abs() + 0.5  # column sums far from zero
    dt = REG_DTYPES[reg]
    return x.to(dt).float(), y.to(dt).float()  # what the kernel holds after converting on load


def _padded(t):
    p = torch.zeros(R, C, device=t.device, dtype=torch.float64)
    p[: t.shape[0], : t.shape[1]] = t
    return p


@pytest.mark.parametrize("shape", [(32, 48), (27, 45), (9, 17)])
@pytest.mark.parametrize("col", [False, True], ids=["row", "col"])
@pytest.mark.parametrize("reg", [0, 1, 2], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("op", sorted(TILE_OPS))
def test_tile_op(lib, op, reg, col, shape):
    if op == 19 and (reg == 0 or col):
        pytest.skip("the shuffle broadcasts take 16-bit row-layout tiles")
    rows, cols = shape
    x, y = _inputs(rows, cols, op, reg)
    out, _ = lib.tile_op(x, y, op, reg, col)
    ref = TILE_OPS[op](_padded(x), _padded(y))
    n = rows * cols
    if op in (12, 13):
        ref = ref[:cols, :rows]
        got = out[:n].view(cols, rows)
    else:
        ref = ref[:rows, :cols]
        got = out[:n].view(rows, cols)
    ref = ref.float().to(REG_DTYPES[reg]).float()  # the kernel rounds its result to the register type
    rtol, atol = _tol(reg)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    assert (out[n:] == 12345).all(), "wrote past the view"


@pytest.mark.parametrize("shape", [(32, 48), (27, 45)])
@pytest.mark.parametrize("col", [False, True], ids=["row", "col"])
@pytest.mark.parametrize("reg", [0, 1], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", sorted(VEC_OPS))
def test_vector_op(lib, op, reg, col, shape):
    rows, cols = shape
    x, y = _inputs(rows, cols, op, reg)
    _, vout = lib.tile_op(x, y, op, reg, col)
    n = rows if op in (20, 21, 24) else cols
    ref = VEC_OPS[op](_padded(x))[:n].float()
    torch.testing.assert_close(vout[:n], ref, rtol=1e-5, atol=1e-4)
    assert (vout[n:] == 12345).all(), "wrote past the vector"


# ---------------------------------------------------------------- wgmma (one warpgroup)

VARIANTS = {0: "AB", 1: "ABt", 2: "AtB", 3: "AtBt", 4: "AB_regA", 5: "ABt_regA"}


@pytest.mark.parametrize("accumulate", [False, True], ids=["mm", "mma"])
@pytest.mark.parametrize("nk", [(64, 64), (256, 32), (48, 128), (16, 16)], ids=lambda t: f"n{t[0]}k{t[1]}")
@pytest.mark.parametrize("variant", sorted(VARIANTS), ids=lambda v: VARIANTS[v])
def test_wgmma(lib, variant, nk, accumulate):
    _wgmma_case(lib, variant, *nk, torch.bfloat16, accumulate)


@pytest.mark.parametrize("variant", sorted(VARIANTS), ids=lambda v: VARIANTS[v])
def test_wgmma_fp16(lib, variant):
    _wgmma_case(lib, variant, 64, 64, torch.float16, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", [0, 1], ids=["AB", "ABt"])
def test_warp_mma(lib, variant, dtype):
    """mma.sync on register tiles (tk/ops/warp/mma.cuh): d += a·b with b as K x N (col-layout load) or N x K."""
    g = torch.Generator(device="cuda").manual_seed(7 + variant)
    a = torch.randn(32, 32, device="cuda", generator=g).to(dtype)
    b = torch.randn(*((32, 48) if variant == 0 else (48, 32)), device="cuda", generator=g).to(dtype)
    d = torch.randn(32, 48, device="cuda", generator=g)
    got = lib.warp_mma_op(a, b, d, variant)
    ref = d + a.float() @ (b.float() if variant == 0 else b.float().t())
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


def _wgmma_case(lib, variant, n, k, dtype, accumulate):
    g = torch.Generator(device="cuda").manual_seed(variant * 100 + n + k)
    at, bt = variant in (2, 3), variant in (1, 3, 5)
    a = torch.randn(*((k, 64) if at else (64, k)), device="cuda", generator=g).to(dtype)
    b = torch.randn(*((n, k) if bt else (k, n)), device="cuda", generator=g).to(dtype)
    d = torch.randn(64, n, device="cuda", generator=g)
    out = lib.wgmma_op(a, b, d, variant, accumulate)
    A = (a.t() if at else a).double()
    B = (b.t() if bt else b).double()
    ref = A @ B + (d.double() if accumulate else 0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- TMA round trips with tails

TMA_TILES = {0: torch.bfloat16, 1: torch.bfloat16, 2: torch.bfloat16, 3: torch.float32, 4: torch.float32, 5: torch.bfloat16}


@pytest.mark.parametrize("tile", sorted(TMA_TILES), ids=["bf16_64x64_sw128", "bf16_64x32_sw64", "bf16_32x16_sw32",
                                                          "fp32_32x32_sw128", "fp32_16x16_sw64", "bf16_64x64_plain"])
def test_tma_roundtrip(lib, tile):
    dtype = TMA_TILES[tile]
    cols = 72 if dtype == torch.bfloat16 else 36  # rows are 144 bytes: a multiple of 16, not of any tile width
    x = torch.randn(2, 3, 100, cols, device="cuda").to(dtype)
    o1, o2 = lib.tma_roundtrip(x, tile)
    assert torch.equal(o1, x), "TMA load and the shared tile's swizzled indexing disagree"
    assert torch.equal(o2, 2 * x), "TMA store and the shared tile's swizzled indexing disagree (or wrote past the edge)"


# ---------------------------------------------------------------- bank conflicts

def test_smem_load_loop_values(lib):
    ref = (torch.arange(64 * 64, device="cuda") % 97).float().view(64, 64) * 3
    for swizzled in (True, False):
        torch.testing.assert_close(lib.smem_load_loop(swizzled, 3), ref)


_NCU_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    from tk_inductor import build
    build.load_folder("tile_tests", {csrc!r})
    for swizzled in (True, False):
        torch.ops.tk_tile_tests.smem_load_loop(swizzled, 64)
    torch.cuda.synchronize()
""")
NCU_METRICS = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"


def bank_conflicts(tmp_path) -> dict[str, dict[str, float]]:
    """Run the two smem_load_kernel instantiations under Nsight Compute; kernel ('swizzled'/'plain') -> metric -> value."""
    ncu = shutil.which("ncu") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/ncu")), None)
    if ncu is None:
        pytest.skip("ncu (Nsight Compute) is not installed")
    script = tmp_path / "ncu_target.py"
    script.write_text(_NCU_SCRIPT.format(repo=str(REPO), csrc=str(REPO / "tests" / "tile" / "csrc")))
    cmd = [ncu, "--clock-control", "none", "--kernel-name", "regex:smem_load_kernel", "--metrics", NCU_METRICS, "--csv",
           sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    text = proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "smem_load_kernel" in line and "l1tex__" in line]
    if proc.returncode != 0 or not rows:
        pytest.skip(f"Nsight Compute counters unavailable here (rc {proc.returncode}): {text[-600:]}")
    parsed = []
    for line in rows:
        fields = [f.strip('"') for f in re.findall(r'"[^"]*"', line)]
        metric = next(f for f in fields if f.startswith("l1tex__"))
        parsed.append((int(fields[0]), metric, float(fields[-1].replace(",", ""))))
    first = min(p[0] for p in parsed)  # the script launches the swizzled kernel first
    found: dict[str, dict[str, float]] = {}
    for launch, metric, value in parsed:
        found.setdefault("swizzled" if launch == first else "plain", {})[metric] = value
    return found


def test_bank_conflicts(tmp_path):
    found = bank_conflicts(tmp_path)
    print("ncu:", found)
    conflicts = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
    assert found["swizzled"][conflicts] == 0, found
    assert found["plain"][conflicts] > 0, found


# ---------------------------------------------------------------- GEMM on LCSF

@pytest.fixture(scope="module")
def gemm_kernel():
    from tk_inductor import build
    import tk_inductor.ops.gemm  # noqa: F401  (registers tk::gemm)

    build.load("gemm")
    return torch.ops.tk_cuda.gemm


def _check_gemm(c, a, b):
    ref = a.float() @ b.float()
    assert c.shape == ref.shape and c.dtype == torch.bfloat16 and not c.isnan().any()
    err = (c.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    assert err <= 1e-2, f"relative error {err:.3g}"


@pytest.mark.parametrize("mnk", [(1, 1, 1), (128, 256, 64), (300, 520, 200), (257, 129, 1000), (17, 33, 45), (1000, 3000, 777),
                                 (2048, 2048, 2048)])
def test_gemm(gemm_kernel, mnk):
    m, n, k = mnk
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    _check_gemm(torch.ops.tk.gemm(a, b), a, b)


def _configs():
    from tk_inductor.ops.gemm import CONFIGS

    return CONFIGS


@pytest.mark.parametrize("n", [900, 643])
@pytest.mark.parametrize("cfg", _configs(), ids=lambda c: f"st{c[0]}{'_tma' if c[1] else ''}{'_overlap' if c[2] else ''}")
def test_gemm_configs(gemm_kernel, cfg, n):
    from tk_inductor.ops import gemm

    a = torch.randn(700, 300, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(300, n, device="cuda", dtype=torch.bfloat16)
    _check_gemm(gemm.configured(a, b, *cfg), a, b)


def test_gemm_strided_inputs(gemm_kernel):
    a = torch.randn(320, 500, device="cuda", dtype=torch.bfloat16).t()  # (500, 320), column-major
    b = torch.randn(640, 330, device="cuda", dtype=torch.bfloat16)[:, :320].t()  # (320, 640) strided
    _check_gemm(torch.ops.tk.gemm(a, b), a, b)


def test_gemm_rejects_bad_inputs(gemm_kernel):
    a = torch.randn(4, 5, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        torch.ops.tk.gemm(a, torch.randn(6, 3, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):
        torch.ops.tk_cuda.gemm(a.float(), torch.randn(5, 3, device="cuda"))
