"""CPU check that the layernorm variant counts agree between the CUDA header, the Python op (which rejects a
bad TK_LN_*_VARIANT before the kernel is called) and the sweep (which must time every variant)."""
from __future__ import annotations

import re
from pathlib import Path

import tk_inductor.ops.layernorm as ln_ops
from benchmarks import sweep_ln

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "kernels" / "layernorm" / "layernorm.h"


def _header_counts() -> tuple[int, int]:
    m = re.search(r"constexpr int kForwardVariants = (\d+), kBackwardVariants = (\d+);", HEADER.read_text())
    assert m, "variant counts not found in layernorm.h"
    return int(m.group(1)), int(m.group(2))


def test_python_counts_match_the_header():
    assert (ln_ops.FORWARD_VARIANTS, ln_ops.BACKWARD_VARIANTS) == _header_counts()


def test_defaults_are_valid_variants():
    text = HEADER.read_text()
    m = re.search(r"kDefaultForwardVariant = (\d+), kDefaultBackwardVariant = (\d+);", text)
    assert m
    fwd, bwd = _header_counts()
    assert int(m.group(1)) < fwd and int(m.group(2)) < bwd


def test_sweep_times_every_variant():
    fwd, bwd = _header_counts()
    assert list(sweep_ln.FWD_VARIANTS) == list(range(fwd))
    assert list(sweep_ln.BWD_VARIANTS) == list(range(bwd))


def test_kernel_names_show_the_split_and_the_time():
    fwd = ("void tk_layernorm::(anonymous namespace)::forward_kernel<__nv_bfloat16, tk_layernorm::Split<128, 1, 128> >"
           "(tk_layernorm::ForwardArgs)")
    lean = "void tk_layernorm::(anonymous namespace)::forward_lean_kernel<float, tk_layernorm::Split<32, 4, 128>, 2>(x)"
    col = "void tk_layernorm::(anonymous namespace)::column_sum_kernel<__nv_bfloat16>(float const*, int, int)"
    assert sweep_ln.short_kernel_name(fwd, 12.34) == "forward_kernel[128x1/128] 12.3us"
    assert sweep_ln.short_kernel_name(lean) == "forward_lean_kernel[32x4/128]"
    assert sweep_ln.short_kernel_name(col, 2.0) == "column_sum 2.0us"
