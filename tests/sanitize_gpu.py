"""compute-sanitizer over one small case of every kernel, forward and backward.

    python tests/sanitize_gpu.py [--tools memcheck,racecheck,synccheck] [--families attention,...] [--log-dir DIR]
        runs this file's cases under each tool in its own process and prints one line per tool: its error count
        and hazards (exit status 1 if any tool reports an error or the cases fail)
    python tests/sanitize_gpu.py --cases
        the cases alone: every kernel launch variant, through the public tk:: ops (strict: a case that falls back
        to the reference fails), forward and autograd backward

The shapes are small (a sanitizer slows a kernel 10-1000x) but reach each kernel's launch variants: attention head
dims 64 and 128, causal or not, GQA, and sliding windows and softcaps at head dims 32 and 96 (zero-filled); rotary NeoX and interleaved, mixed dtypes; layernorm at each hidden-size tier,
with residual, dropout, bias and gate, and the row-kernel and persistent backward; Based on small and wide
grids; the SSD with two heads per task, a short last task of a group, more tasks than SMs, and sequences
split into segments.
memcheck runs with PyTorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so that every tensor is its
own allocation and an access past a tensor's end is outside any allocation, not in a neighbouring tensor.
racecheck reports raw byte copies into a ring (tk::tma::load_bytes_async: the attention backward's lse2/delta, the
SSD's dt per chunk) as races with the consumers' reads, in both orders: it attributes the copy's write to the issuing
thread and does not see the semaphores that order them (as 2-D tensor copies, which it follows, 0 hazards; they cost
the D = 128 causal backward 3.5%). A report whose every write is such a copy is counted apart as known
(KNOWN_RACES); so is one in cuBLAS's kernels (VENDOR_KERNELS: the Hedgehog weight gradient's matmul), whose
pipelines racecheck does not follow either. Any other race is an error.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck")
FAMILIES = ("attention", "rotary", "layernorm", "linear_attention", "ssd")


def cases(families):
    import torch

    from tk_inductor import build, config
    from tk_inductor.ops import _dispatch, attention, layernorm, linear_attention, rotary, ssd  # noqa: F401 (the ops)

    called = []
    real = _dispatch.kernel
    _dispatch.kernel = lambda name: (called.append(name), real(name))[1]
    for family in families:
        build.load(family)
    torch.manual_seed(0)
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(name, fn, *tensors, expect=()):
        called.clear()
        leaves = [t.requires_grad_() for t in tensors]
        with config.patch(strict=True):
            outs = fn(*leaves)
            outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.grad(outs, leaves, [torch.randn_like(o) for o in outs], allow_unused=True)
        torch.cuda.synchronize()
        missing = [k for k in expect if k not in called]
        assert not missing, f"{name}: kernels {missing} not called (called {called})"
        print(f"ok {name}: {called}", flush=True)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev).to(dtype)

    for D in (64, 128) if "attention" in families else ():
        for causal in (False, True):
            for dtype in (torch.bfloat16, torch.float16):
                q, k, v = rand(1, 4, 130, D, dtype=dtype), rand(1, 2, 97, D, dtype=dtype), rand(1, 2, 97, D, dtype=dtype)
                run(f"attention D{D} causal={causal} {dtype}",
                    lambda q, k, v: torch.ops.tk.attention(q, k, v, causal, D ** -0.5), q, k, v,
                    expect=("attention", "attention_backward"))
        # the score modifications (the window's leading masked blocks, the capped kernels) at a head dim zero-filled
        # to D
        d = {64: 32, 128: 96}[D]
        q, k, v = rand(1, 4, 300, d), rand(1, 2, 300, d), rand(1, 2, 300, d)
        for window, cap in ((70, 0.0), (0, 5.0), (150, 5.0)):
            run(f"attention D{d} causal window={window} softcap={cap}",
                lambda q, k, v: torch.ops.tk.attention(q, k, v, True, 0.1, window, cap), q, k, v,
                expect=("attention", "attention_backward"))
        # interval tables: padding (right, left, none, empty) with packed sequences, causal and not
        keep = torch.zeros(4, 300, dtype=torch.bool, device=dev)
        keep[0, :170] = keep[1, 77:] = keep[2] = True
        segments = (torch.arange(300, device=dev) // 90).expand(4, 300)
        q, k, v = rand(4, 4, 300, D), rand(4, 2, 300, D), rand(4, 2, 300, D)
        for causal in (False, True):
            run(f"attention_varlen D{D} causal={causal}",
                lambda q, k, v: torch.ops.tk.attention_varlen(q, k, v, keep, segments, causal, 0.1), q, k, v,
                expect=("attention", "attention_backward"))
        # decode steps (the split-KV kernels): one row tile and one split, four row tiles and several splits, a
        # padding mask with an entry without keys
        for N, Hq, M in ((1, 4, 97), (16, 8, 3000)):
            q, k, v = rand(2, Hq, N, D), rand(2, 2, M, D), rand(2, 2, M, D)
            run(f"attention decode D{D} N{N} Hq{Hq} M{M}",
                lambda q, k, v: torch.ops.tk.attention(q, k, v, False, 0.1), q, k, v,
                expect=("attention", "attention_backward"))
        q, k, v = rand(4, 4, 1, D), rand(4, 2, 300, D), rand(4, 2, 300, D)
        run(f"attention_varlen decode D{D}",
            lambda q, k, v: torch.ops.tk.attention_varlen(q, k, v, keep, None, False, 0.1), q, k, v,
            expect=("attention", "attention_backward"))

    for interleaved in (False, True) if "rotary" in families else ():
        for x_dtype, table in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                               (torch.float32, torch.float32)):
            q, k = rand(2, 37, 4, 96, dtype=x_dtype), rand(2, 37, 1, 96, dtype=x_dtype)
            cos, sin = rand(37, 1, 64, dtype=table), rand(37, 1, 64, dtype=table)
            run(f"rotary interleaved={interleaved} {x_dtype}/{table}",
                lambda q, k: torch.ops.tk.rotary(q, k, cos, sin, interleaved, False, False), q, k,
                expect=("rotary",))

    seed = torch.tensor([1234, 0], dtype=torch.int64)
    for hidden in (256, 512, 1024, 2048, 3000, 4096, 5120, 6144, 8192, 16384) if "layernorm" in families else ():
        for rows in (3, 4 * sms + 5):
            x, r, w, b = rand(rows, hidden), rand(rows, hidden), rand(hidden, dtype=torch.float32), \
                rand(hidden, dtype=torch.float32)
            run(f"layernorm {rows}x{hidden} residual+dropout+bias",
                lambda x, r, w, b: torch.ops.tk.layernorm(x, r, w, b, seed, 1e-5, 0.1, False)[:2], x, r, w, b,
                expect=("layernorm", "layernorm_backward"))
            x, w = rand(rows, hidden), rand(hidden)
            run(f"rmsnorm {rows}x{hidden}", lambda x, w: torch.ops.tk.layernorm(x, None, w, None, None, 1e-6, 0.0,
                                                                                   True)[:1], x, w,
                expect=("layernorm", "layernorm_backward"))
            x, g, w = rand(rows, hidden, dtype=torch.float32), rand(rows, hidden), rand(hidden)
            run(f"gated rmsnorm {rows}x{hidden}",
                lambda x, g, w: torch.ops.tk.layernorm(x, None, w, None, None, 1e-6, 0.0, True, True, torch.bfloat16,
                                                       g)[:1],
                x, g, w, expect=("layernorm", "layernorm_backward"))

    for bh in (2, 4 * sms) if "linear_attention" in families else ():  # a small grid and one past the SMs
        for normalize in (False, True):
            q, k, v = rand(1, bh, 130, 16), rand(1, bh, 130, 16), rand(1, bh, 130, 64)
            run(f"based B1 H{bh} normalize={normalize}",
                lambda q, k, v: torch.ops.tk.linear_attention(q, k, v, "based", None, None, 0.25, normalize, 1e-6),
                q, k, v, expect=("linear_attention", "linear_attention_backward"))
            for fm, dk in (("elu1", 64), ("identity", 128)):
                q, k, v = rand(1, bh, 130, dk), rand(1, bh, 130, dk), rand(1, bh, 130, 128)
                run(f"{fm} dk{dk} B1 H{bh} normalize={normalize}",
                    lambda q, k, v, fm=fm: torch.ops.tk.linear_attention(q, k, v, fm, None, None, 0.25, normalize,
                                                                         1e-6),
                    q, k, v, expect=("linear_attention", "linear_attention_backward"))
            for dk, f, shape in ((64, 64, (bh, 64, 64)), (128, 32, (128, 32))):  # per-head and shared weights
                q, k, v = rand(1, bh, 130, dk), rand(1, bh, 130, dk), rand(1, bh, 130, 64)
                wq, wk = rand(*shape, dtype=torch.float32) / 8, rand(*shape, dtype=torch.float32) / 8
                run(f"hedgehog dk{dk} f{f} B1 H{bh} normalize={normalize}",
                    lambda q, k, v, wq, wk: torch.ops.tk.linear_attention(q, k, v, "hedgehog", wq, wk, 1.0, normalize,
                                                                          1e-6),
                    q, k, v, wq, wk, expect=("linear_attention", "linear_attention_backward"))

    # tasks of two heads, a group's short last task (3 heads per group), more tasks than SMs, sequences split into
    # segments (few tasks: 21 chunks in segments of 5, the last of one chunk)
    for b, nh, ng, l in ((2, 4, 2, 130), (1, 6, 2, 130), (2, sms + 2, 1, 130), (1, 6, 2, 1300)) \
            if "ssd" in families else ():
        p, n = 64, 128
        x, dt = rand(b, l, nh, p), torch.nn.functional.softplus(torch.randn(b, l, nh, device=dev) - 1)
        A, B, C = -torch.rand(nh, device=dev) - 0.1, rand(b, l, ng, n), rand(b, l, ng, n)
        D, h0 = torch.randn(nh, device=dev), torch.randn(b, nh, p, n, device=dev)
        run(f"ssd b{b} nh{nh} l{l}", lambda x, dt, B, C, h0: torch.ops.tk.ssd(x, dt, A, B, C, D, h0, 64),
            x, dt, B, C, h0, expect=("ssd", "ssd_backward"))
    _dispatch.kernel = real


# Writes racecheck reports although semaphores order them: the raw byte copies it cannot follow (module docstring).
KNOWN_RACES = ("tk::tma::load_bytes_async",)
VENDOR_KERNELS = ("nvjet_",)  # cuBLAS's GEMM kernels on sm_90


def summary(tool: str, log: str) -> tuple[int, str]:
    """(errors, the tool's summary line) from a compute-sanitizer log. For racecheck the count is of reports (a
    write and the accesses it races with) whose write is not one of KNOWN_RACES: the tool's own error total does not
    split by report (one report's accesses may count as one error or several), so the line gives both."""
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", log)
    race = re.search(r"RACECHECK SUMMARY: [^\n]*", log)  # racecheck's own line
    if m:
        return int(m.group(1)), m.group(0)
    if race:
        reports = re.split(r"(?=Error: Race reported between )", log)[1:]

        def is_known(report: str) -> bool:  # every write it names is a known copy
            writes = re.findall(r"Write access at ([^\n]*)", report.partition("RACECHECK SUMMARY")[0])
            return bool(writes) and all(any(k in w for k in KNOWN_RACES) or w.startswith(VENDOR_KERNELS)
                                        for w in writes)

        unknown = [r for r in reports if not is_known(r)]
        known = len(reports) - len(unknown)
        line = race.group(0) + f"; {len(reports)} reports, {known} of them known (KNOWN_RACES, VENDOR_KERNELS)"
        return len(unknown), line
    return -1, "no summary line (the tool did not finish)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", action="store_true", help="run the cases without a sanitizer")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--log-dir", default=None, help="write each tool's full log here")
    ap.add_argument("--families", default=",".join(FAMILIES), help="the kernel families whose cases run")
    args = ap.parse_args()
    if args.cases:
        cases(args.families.split(","))
        return 0
    failed = False
    for tool in args.tools.split(","):
        env = dict(os.environ)
        if tool == "memcheck":
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        # racecheck prints every report, so that each is classified (summary)
        cmd = ["compute-sanitizer", f"--tool={tool}", "--print-limit=" + ("100000" if tool == "racecheck" else "20")]
        cmd += ["--leak-check=no"] if tool == "memcheck" else []
        cmd += [sys.executable, __file__, "--cases", "--families", args.families]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.log_dir) / f"sanitize_{tool}.log").write_text(log)
        errors, line = summary(tool, log)
        print(f"{tool}: {line}; {len(re.findall(r'^ok ', log, re.M))} cases, exit status {proc.returncode}", flush=True)
        failed |= errors != 0 or proc.returncode != 0
        if proc.returncode != 0 and errors <= 0:
            print(log[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
