"""The backend under DDP and FSDP2, two processes (torchrun).

On two GPUs (NCCL, bf16 kernels; skipped with fewer) and on the CPU (gloo, a small fp32 model, ops in reference
mode), where DDP's graph splitting and FSDP2's graph breaks hand the causal mask from one graph to the next: the same
families must be replaced as in one process and the losses must match. (transformers 5.17, the device's,
materialises the causal mask while tracing and hands it across the split as a graph input, which only
`tk::attention_masked` replaces; 5.24 passes no mask there. Both must work.)
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.common import MULTICAST_OFF

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
ARGS = {
    "cuda": ["--layers", "2", "--seq", "1024", "--global-batch", "4", "--steps", "4"],
    "cpu": ["--cpu", "--layers", "2", "--seq", "64", "--global-batch", "4", "--steps", "3"],
}
DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs")])]


def _run(cmd):
    env = dict(os.environ, **MULTICAST_OFF, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])[0]


@pytest.fixture(scope="module", params=DEVICES)
def single(request):
    device = request.param
    return device, _run([sys.executable, "-m", "benchmarks.distributed", "--engine", "single", *ARGS[device]])


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_engine_matches_single_process(engine, single):
    device, ref = single
    got = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "-m", "benchmarks.distributed", "--engine", engine, *ARGS[device]])
    assert ref["replaced"].keys() == {"attention", "layernorm", "rotary"}, ref
    assert got["replaced"].keys() == ref["replaced"].keys(), (got["replaced"], got["kept"])
    assert not [r for f, r in got["kept"] if f == "attention"], got["kept"]
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= 2e-2 * abs(b), (got["losses"], ref["losses"])
    # one compilation, not one per step (DDP's graph splitting may add a few graphs)
    assert got["frames_compiled"] <= 8
    # a mask handed across the split was proven by the graph that made it, so its values are never read
    paths = got["masked_attention_paths"]
    if set(paths) - {"proofs"}:
        assert paths.get("proofs", 0) >= 1, paths
        assert paths.get("value checks", 0) == 0, paths
