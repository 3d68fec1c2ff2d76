"""The benchmark harness's CPU-side pieces: tables, row conversion, plots (timing itself needs the GPU)."""
import pytest

from benchmarks.__main__ import _as_rows, _e2e_speedups, main, plot, table
from benchmarks.common import Row, bandwidth_table


ROWS = [
    Row("attention", "B16 H16 N4096 D128 full fwd", "ours", 1.0, 500.0, "TFLOPS", 4096),
    Row("attention", "B16 H16 N4096 D128 full fwd", "cudnn", 1.25, 400.0, "TFLOPS", 4096),
    Row("attention", "B16 H16 N4096 D128 full fwd", "flash", None, note="not installed"),
]


def test_table_reports_ratio_and_missing_baselines():
    text = table(ROWS)
    assert "cudnn 1.250 ms 400 TFLOPS (ours 1.25x)" in text
    assert "flash: not installed" in text


def test_rows_from_dicts():
    assert _as_rows([{"op": "a", "case": "c", "impl": "ours", "ms": 1.0}])[0] == Row("a", "c", "ours", 1.0)


def test_bandwidth_table_percent_of_copy():
    rows = [Row("rotary", "copy", "copy", 1.0, 4000.0, "GB/s"),
            Row("rotary", "x fwd", "ours", 1.0, 3600.0, "GB/s"),
            Row("rotary", "x fwd", "torch.compile", 2.0, 1800.0, "GB/s")]
    text = bandwidth_table(rows, ["torch.compile"])
    assert "| x fwd | 3600 | 90% | 1800 | 2.00 |" in text


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert [p.name for p in plot(ROWS, tmp_path)] == ["attention.png"]


def test_unknown_op_is_reported_not_dropped(tmp_path, capsys):
    main(["--ops", "nosuchop", "--out", str(tmp_path)])
    assert "no benchmark module" in capsys.readouterr().out


E2E = [Row("e2e", "llama 2x4096 train", "eager", 300.0), Row("e2e", "llama 2x4096 train", "torch.compile", 150.0),
       Row("e2e", "llama 2x4096 train", "thunderkittens", 100.0),
       Row("e2e", "based 4x4096 train", "torch.compile", None, note="failed"),
       Row("e2e", "based 4x4096 train", "thunderkittens", 50.0)]


def test_e2e_speedups_and_plot(tmp_path):
    assert _e2e_speedups(E2E) == {"llama 2x4096 train": {"eager": 3.0, "torch.compile": 1.5},
                                  "based 4x4096 train": {}}
    pytest.importorskip("matplotlib")
    assert [p.name for p in plot(ROWS + E2E, tmp_path)] == ["attention.png", "e2e.png"]
