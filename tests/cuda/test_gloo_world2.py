"""World 2 on one GPU: two processes on ``cuda:0``, gloo, CUDA tensors; skipped without a GPU.

``world2.py`` runs each scenario in a fresh process (CUDA stays out of the test
process) that spawns the two ranks; the test kills the whole process group if
it outlives its timeout. The checks are plain functions of the scenario's JSON,
so they can be run on the output of ``world2.py --device cpu`` too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from results import keep

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_gloo_available()),
    reason="needs a CUDA GPU (and gloo)",
)

HERE = Path(__file__).resolve().parent
FP32_TOL = 1e-6
# bf16 gradients are computed and summed in bf16 (the bucket is all-reduced in the model dtype), so
# they match the exact fp32 average to a few units of bf16's precision (2**-7), as on CPU
# (tests/facade/test_equivalence.py); given them, the fp32 master step is exact in both dtypes.
GRAD_TOL = {"fp32": FP32_TOL, "bf16": 8 * 2**-7}
WARMUP = 1  # probed steps not checked (first pinned host buffers and allocations)


def run_world2(*args: str, timeout: float = 300.0) -> list[dict[str, Any]]:
    """``world2.py *args`` in its own process group; the per-rank results."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "world2.py"), *args, "--timeout", str(timeout - 30)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and both ranks
        out, err = proc.communicate()
        pytest.fail(f"world2.py {' '.join(args)} ran past {timeout} s:\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]
    ranks = json.loads(out.strip().splitlines()[-1])["ranks"]
    keep("world2-" + "-".join(a.lstrip("-") for a in args), ranks)
    return ranks


def check_train(ranks: list[dict[str, Any]], dtype: str, device: str = "cuda") -> None:
    """Rank 0 matched the reference every step; both ranks end bit-identical; only gloo's collectives."""
    first = ranks[0]
    assert first["device"].startswith(device), first["device"]  # the flat buffers live on the GPU
    assert first["buckets"] > 1
    assert set(first["collectives"]) == {"all_reduce", "broadcast"}, first["collectives"]
    assert len(first["errors"]) == len(first["grad_errors"]) > 0
    assert max(first["grad_errors"]) <= GRAD_TOL[dtype], first["grad_errors"]
    assert max(first["errors"]) < FP32_TOL, first["errors"]
    assert all(r["params_sha256"] == first["params_sha256"] for r in ranks)


def check_overlap(ranks: list[dict[str, Any]]) -> None:
    """See [Note: overlap probe] in ``world2_overlap.py``."""
    for rank, result in enumerate(ranks):
        assert result["overlap"]["buckets"] > 2, result["overlap"]
        for s in result["overlap"]["steps"][WARMUP:]:
            assert s["launched_before_stall"] >= 2, (rank, s)  # launched from backward hooks ...
            assert s["reduced_while_busy"], (rank, s)  # ... and done while backward still ran
            # The first launch precedes the stall in stream order: at least the stall before the end.
            assert s["stall_ms"] - 1.0 <= s["first_launch_ms_before_backward_end"] <= s["backward_ms"], s
        for s in result["no_overlap"]["steps"]:  # the control: the probe sees no reduction at all
            assert s["launched_in_backward"] == 0, (rank, s)
            assert not s["reduced_while_busy"], (rank, s)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_world_2_on_one_gpu_over_gloo_matches_adamw(stage, dtype):
    check_train(run_world2("train", "--stage", str(stage), "--dtype", dtype), dtype)


def test_bucket_reductions_run_while_backward_computes():
    check_overlap(run_world2("overlap"))
