"""The benchmark harness's CPU-side pieces: tables, row conversion, plots (timing itself needs the GPU)."""
import json

import pytest
import torch

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
    if not torch.cuda.is_available():  # one clear line and a non-zero status, no traceback
        assert main(["--ops", "nosuchop", "--out", str(tmp_path)]) == 2
        assert "no CUDA device" in capsys.readouterr().err
        return
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


def _fake_child(script):
    """A stand-in for the e2e child process: runs `script` with the sink path as argv[1]."""
    import sys

    return lambda name, mode, sink, quick, precision="bf16": [sys.executable, "-c", script, str(sink)]


def test_e2e_child_timeout_keeps_finished_phases(monkeypatch):
    from benchmarks import e2e

    row = {"op": "e2e", "case": e2e.case_name("based", "forward"), "impl": "torch.compile", "ms": 10.0}
    script = ("import json, sys, time; open(sys.argv[1], 'a').write(json.dumps(%r) + '\\n'); time.sleep(60)" % row)
    monkeypatch.setattr(e2e, "_child_cmd", _fake_child(script))
    rows = e2e._bench_in_child("based", "torch.compile", quick=False, timeout_s=3)
    assert [(r.case, r.ms) for r in rows] == [("based 4x4096 forward", 10.0), ("based 4x4096 train", None)]
    assert rows[1].note == "did not finish within 3 s (compilation included)"


def test_e2e_child_crash_is_reported_for_each_phase(monkeypatch):
    from benchmarks import e2e

    monkeypatch.setattr(e2e, "_child_cmd", _fake_child("raise SystemExit(3)"))
    rows = e2e._bench_in_child("mamba2", "eager", quick=True, timeout_s=30)
    assert [(r.case, r.impl, r.ms, r.note) for r in rows] == [
        ("mamba2 1x4096 forward", "eager", None, "exited with status 3"),
        ("mamba2 1x4096 train", "eager", None, "exited with status 3")]


def test_e2e_hf_fast_path_without_its_packages_is_reported_missing(monkeypatch, tmp_path):
    """HF Mamba2's fast path (mode mamba_ssm) needs mamba_ssm and causal_conv1d in .mamba/: without them each phase
    gets a row saying what is missing, and no model is built; the other modes run with .mamba/ off sys.path."""
    import json
    import sys

    from benchmarks import e2e

    monkeypatch.setattr(e2e, "MAMBA_DIR", tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    monkeypatch.setattr(e2e, "bench_model", lambda *a, **k: pytest.fail("no model without HF's kernels"))
    sink = tmp_path / "rows.jsonl"
    assert e2e._child_main(["--child", "mamba2", e2e.HF_KERNELS, str(sink), "--quick"]) == 0
    rows = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [(r["case"], r["impl"], r["ms"]) for r in rows] == [
        ("mamba2 1x4096 forward", "mamba_ssm", None), ("mamba2 1x4096 train", "mamba_ssm", None)]
    assert all(r["note"].startswith("missing: ") for r in rows)
    assert e2e._hf_kernels_path(False) is None and str(tmp_path) not in sys.path


def test_e2e_rejects_unknown_models_and_modes():
    from benchmarks import e2e

    with pytest.raises(ValueError, match="unknown e2e models"):
        e2e.run(models=["llama-sdpa", "gpt5"])
    with pytest.raises(ValueError, match="unknown e2e modes"):
        e2e.run(modes=["jit"])


def test_plot_series_drop_the_words_that_change_along_x():
    from benchmarks.__main__ import _series

    assert _series(Row("attention", "B64 H16 N1024 D128 causal fwd+bwd", "ours", 1.0, 1.0, "TFLOPS", 1024)) == (
        "fwd+bwd", "ours", "H16 D128 causal")
    assert _series(Row("layernorm", "65536x1024 ln+residual bf16 bwd", "ours", 1.0, 1.0, "GB/s", 1024)) == (
        "bwd", "ours", "ln+residual bf16")
    assert _series(Row("rotary", "B16 H16 N4096 D128 rotary_dim 32 fwd", "eager", 1.0, 1.0, "GB/s", 128)) == (
        "fwd", "eager", "H16 rotary_dim 32")
    assert _series(Row("gemm", "4096^3", "cublas", 1.0, 1.0, "TFLOPS", 4096)) == ("", "cublas", "")


def test_plot_takes_implementation_names_with_spaces(tmp_path):
    """The linear-attention and SSD tables name baselines "fla parallel_based", "ours 32-col tiles" (a device run
    once failed here after the table had printed)."""
    pytest.importorskip("matplotlib")
    from benchmarks.__main__ import plot

    rows = [Row("linear_attention", f"B4 H16 N{n} d16 dv64 based fwd", impl, 1.0, float(n), "Mtok/s", n)
            for n in (1024, 4096) for impl in ("ours", "ours 32-col tiles", "fla parallel_based")]
    assert [p.name for p in plot(rows, tmp_path)] == ["linear_attention.png"]


def test_distributed_gap_summary_merges_streams_and_ranks_gaps():
    import types

    import torch

    from benchmarks.distributed import _gaps

    def event(start, end, name):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=start, end=end), name=name,
                                     device_type=torch.autograd.DeviceType.CUDA)

    # b overlaps a (two streams), d lies inside c: two gaps, 40 us after c, 30 us after b
    text = _gaps([event(0, 10, "a"), event(5, 20, "b"), event(50, 60, "c"), event(55, 58, "d"),
                  event(100, 101, "e")], wall=0.001)
    assert "2 idle gaps" in text
    lines = text.splitlines()[1:]
    assert "40.0 us  after c  before e" in lines[0] and "30.0 us  after b  before c" in lines[1]


def _results(path, rows, kernels="k1", commit="c1"):
    import dataclasses
    import json

    meta = {"date": "2026-11-29", "commit": commit, "torch": "2.11", "gpu": "H200", "kernels": kernels}
    path.write_text(json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}))
    return str(path)


def test_merge_joins_parts_and_later_rows_win(tmp_path, capsys):
    import json

    a = _results(tmp_path / "a.json", ROWS)
    newer = Row("attention", "B16 H16 N4096 D128 full fwd", "ours", 0.5, 1000.0, "TFLOPS", 4096)
    b = _results(tmp_path / "b.json", [newer] + E2E, commit="c2")
    assert main(["--merge", a, b, "--out", str(tmp_path / "m")]) == 0
    text = capsys.readouterr().out
    assert "merged from 2 runs" in text and "cudnn 1.250 ms 400 TFLOPS (ours 2.50x)" in text
    assert "llama 2x4096 train" in text
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert merged["meta"]["commit"] == "c2" and [p["commit"] for p in merged["meta"]["parts"]] == ["c1", "c2"]
    assert len(merged["rows"]) == len(ROWS) + len(E2E)


def test_merge_refuses_parts_of_different_kernels(tmp_path):
    a = _results(tmp_path / "a.json", ROWS, kernels="k1")
    b = _results(tmp_path / "b.json", E2E, kernels="k2")
    with pytest.raises(SystemExit, match="different kernel sources"):
        main(["--merge", a, b, "--out", str(tmp_path / "m")])
    assert main(["--merge", a, b, "--allow-mixed", "--out", str(tmp_path / "m")]) == 0


def test_a_run_cut_off_keeps_the_finished_parts(tmp_path, monkeypatch, capsys):
    import json

    from benchmarks import e2e

    def child(name, mode, quick, timeout_s, precision="bf16"):
        if mode == "thunderkittens":
            raise KeyboardInterrupt  # stands in for the kill of a time limit
        return [Row("e2e", e2e.case_name(name, "forward"), mode, 10.0)]

    import benchmarks.__main__ as driver

    monkeypatch.setattr(driver, "cuda_visible", lambda: True)  # the children are faked: no GPU needed
    monkeypatch.setattr(e2e, "_child_cmd", None)  # nothing may start a real child
    monkeypatch.setattr(e2e, "_bench_in_child", child)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        main(["--ops", "none", "--e2e", "--models", "based", "--out", str(out)])
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["partial"] is True
    assert [r["impl"] for r in data["rows"]] == ["eager", "torch.compile"]
    assert main(["--merge", str(out / "results.json"), "--out", str(tmp_path / "m")]) == 0
    assert "is partial" in capsys.readouterr().out
    monkeypatch.setattr(e2e, "_bench_in_child", lambda name, mode, quick, timeout_s, precision="bf16": [])
    assert main(["--ops", "none", "--e2e", "--models", "based", "--out", str(out)]) == 0
    assert "partial" not in json.loads((out / "results.json").read_text())["meta"]


def test_commit_from_environment(monkeypatch):
    from benchmarks.__main__ import _commit

    monkeypatch.setenv("TK_BENCH_COMMIT", "abc1234")
    assert _commit() == "abc1234"


def test_a_stopped_run_leaves_no_e2e_child(tmp_path):
    """SIGTERM (what `timeout` sends) to `python -m benchmarks` must take the model's child process with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    # the e2e child is replaced by one that records its pid and sleeps
    script = (f"import os, time, sys; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    runner = (
        "import sys, runpy, torch\n"
        "torch.cuda.is_available = lambda: True\n"  # the child is faked: no GPU needed
        "torch.cuda.get_device_name = lambda *a: 'none'\n"
        "from benchmarks import e2e\n"
        f"e2e._child_cmd = lambda name, mode, sink, quick, precision: [sys.executable, '-c', {script!r}]\n"
        "sys.argv = ['benchmarks', '--ops', 'none', '--e2e', '--models', 'based', '--modes', 'eager',"
        f" '--out', {str(tmp_path / 'out')!r}]\n"
        "runpy.run_module('benchmarks', run_name='__main__')\n")
    proc = subprocess.Popen([sys.executable, "-c", runner], cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    deadline = time.time() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline and proc.poll() is None, "the child never started"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_linear_attention_baseline_computes_the_op():
    """The benchmark's torch.compile baseline (the Based model's quadratic spelling) is tk::linear_attention
    'based' with scale d^-1/2, normalised: same numbers, so the ratio compares equal work."""
    import math

    import torch

    from benchmarks.linear_attention import quadratic
    from tk_inductor.ops import linear_attention as la

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 70, 16, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 3, 70, 8, generator=g, dtype=torch.float64)
    want = la.linear_attention_reference(q, k, v, "based", None, None, 1 / math.sqrt(16), True, 1e-6)
    torch.testing.assert_close(quadratic(q, k, v), want, rtol=1e-10, atol=1e-10)


def test_ssd_fla_baseline_mapping_is_the_op():
    """The benchmark runs FLA's simple GLA as SSD with q = C, k = B, v = dt·x, gate dt·A: check that mapping with
    a plain simple-GLA recurrence (FLA's definition) against the SSD reference, in fp64 on the CPU."""
    import torch

    from tk_inductor.ops import ssd as ssd_ops

    g = torch.Generator().manual_seed(0)
    b, l, nh, p, n = 1, 37, 2, 3, 4
    x = torch.randn(b, l, nh, p, generator=g, dtype=torch.float64)
    dt = torch.rand(b, l, nh, generator=g, dtype=torch.float64)
    A = -torch.rand(nh, generator=g, dtype=torch.float64)
    B, C = (torch.randn(b, l, 1, n, generator=g, dtype=torch.float64) for _ in range(2))
    D = torch.randn(nh, generator=g, dtype=torch.float64)
    q, k, v, gate = C.expand(b, l, nh, n), B.expand(b, l, nh, n), x * dt.unsqueeze(-1), dt * A
    S = torch.zeros(b, nh, n, p, dtype=torch.float64)
    outs = []
    for t in range(l):  # simple GLA: S_t = exp(g_t) S_{t-1} + k_tᵀ v_t, o_t = q_t S_t
        S = gate[:, t, :, None, None].exp() * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhn,bhnp->bhp", q[:, t], S))
    got = torch.stack(outs, 1) + D[:, None] * x
    want = ssd_ops.ssd_reference(x, dt, A, B, C, D, None, 8)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_check_and_time_reports_a_wrong_or_failing_implementation():
    import torch

    from benchmarks.common import check_and_time

    ref = torch.ones(4)

    def crash():
        raise RuntimeError("no kernel image")

    rows = check_and_time("ssd", "case", {"wrong": lambda: ref * 2, "crash": crash}, ref, 1, "Mtok/s", lambda ms: ms)
    assert [(r.impl, r.ms) for r in rows] == [("wrong", None), ("crash", None)]
    assert "relative error" in rows[0].note and "no kernel image" in rows[1].note


def test_timeline_splits_iterations_by_position():
    from benchmarks.tuning.profile_backward import iterations

    # a step whose own kernels include an elementwise one, like the flush: iterations are told apart by count
    names = ["fill", "main", "elementwise", "sum"] * 3
    assert iterations(names, 3) == [["fill", "main", "elementwise", "sum"]] * 3
    with pytest.raises(RuntimeError, match="not the same kernels"):
        iterations(names[:-1], 3)


def test_before_after_table_medians_ratios_and_errors(tmp_path):
    from benchmarks.tuning.before_after import table

    path = tmp_path / "m.jsonl"
    rows = [("old", "a fwd", 2.0), ("new", "a fwd", 1.0), ("old", "a fwd", 2.2), ("new", "a fwd", 1.1),
            ("old", "a fwd", 9.0), ("new", "a fwd", 1.05), ("old", "b bwd", 1.0)]
    lines = [json.dumps({"tree": t, "case": c, "ms": ms}) for t, c, ms in rows]
    lines.append(json.dumps({"tree": "new", "case": "b bwd", "ms": None, "error": "RuntimeError: no kernel"}))
    path.write_text("\n".join(lines) + "\n")
    text = table(str(path), ["old", "new"]).splitlines()
    assert text[1].split() == ["a", "fwd", "2.2000", "1.0500", f"{2.2 / 1.05:.3f}x"]  # medians of three rounds
    assert text[2].split() == ["b", "bwd", "1.0000", "error"]
    assert text[3] == "new b bwd: RuntimeError: no kernel"
