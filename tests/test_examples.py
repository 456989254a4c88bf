"""The training examples under torchrun (2 processes on gloo), as a user launches them."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# A short bf16 run: 12 steps of 8 sequences in 2 micro-batches per rank, warmup 2, log every 4 steps.
SHORT = ("--steps", "12", "--warmup", "2", "--global-batch", "8", "--log-every", "4")
_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, *args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node NPROC examples/SCRIPT ARGS`` in a fresh interpreter."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(_free_port()),
        str(EXAMPLES / script),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=_ENV, timeout=300)


def one_by_one(**runs: tuple) -> dict[str, subprocess.CompletedProcess[str]]:
    """Several ``torchrun`` calls (``name=(script, *args)`` or ``(script, *args, {nproc})``), one after
    the other: each already runs a process per core, more at once would only contend for them."""
    results = {}
    for name, (script, *args) in runs.items():
        options = args.pop() if args and isinstance(args[-1], dict) else {}
        results[name] = torchrun(script, *args, **options)
    return results


def losses(out: subprocess.CompletedProcess[str]) -> tuple[float, float]:
    """(first, final) loss from the closing line, the final one at full precision."""
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    match = re.search(r"done: loss ([\d.]+) -> [\d.]+ \(steps \d+-\d+\); final (\S+)", out.stdout)
    assert match, out.stdout
    return float(match.group(1)), float(match.group(2))


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_CHECKPOINT = importlib.util.find_spec("zeroplan.facade.checkpoint") is not None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted runs, and the first half of an interrupted one, started together."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    started = {"gpt": ("train_gpt.py", *SHORT)}
    if HAS_TRANSFORMERS:
        started["hf"] = ("train_hf_gpt2.py", *SHORT)
    if HAS_CHECKPOINT:  # --resume on an empty directory starts from step 0
        started["first_half"] = (
            "train_gpt.py", *SHORT, "--ckpt-dir", str(ckpt), "--ckpt-every", "4", "--stop-at", "8", "--resume"
        )  # fmt: skip
    results = one_by_one(**started)
    results["ckpt"] = ckpt
    return results


def test_train_gpt_under_torchrun_learns(runs):
    out = runs["gpt"]
    first, final = losses(out)
    assert final < first - 0.2, out.stdout
    assert "231,744 parameters, bf16, world 2, stage 2, shard groups of 2" in out.stdout
    steps = re.findall(r"^step\s+(\d+)/12 \| loss [\d.]+ \| lr ([\d.e+-]+) \| grad norm", out.stdout, re.M)
    assert [int(s) for s, _ in steps] == [1, 4, 8, 12]
    rates = [float(lr) for _, lr in steps]
    assert rates[1] > rates[0] and rates[3] < rates[1]  # warmup, then cosine decay


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install 'zeroplan[hf]')")
def test_train_hf_gpt2_under_torchrun_learns(runs):
    out = runs["hf"]
    first, final = losses(out)
    assert final < first - 0.2, out.stdout
    assert "168,192 parameters, bf16, world 2" in out.stdout  # tied embedding and head counted once


@pytest.mark.skipif(not HAS_CHECKPOINT, reason="zeroplan.facade.checkpoint has not landed")
def test_resume_continues_the_run_exactly_and_at_another_world_size(runs, tmp_path):
    first_half = runs["first_half"]
    losses(first_half)
    assert "no checkpoint in" in first_half.stdout and "saved step 8" in first_half.stdout
    elastic = tmp_path / "elastic"
    shutil.copytree(runs["ckpt"], elastic)
    resumed = one_by_one(
        same=("train_gpt.py", *SHORT, "--ckpt-dir", str(runs["ckpt"]), "--resume"),
        # ... on one process, with the optimizer offloaded (its CPU step is fused AdamW)
        elastic=(
            "train_gpt.py",
            *SHORT,
            "--ckpt-dir",
            str(elastic),
            "--resume",
            "--offload",
            "optimizer",
            {"nproc": 1},
        ),
    )
    _, expected = losses(runs["gpt"])
    for name, out in resumed.items():
        assert "at step 8" in out.stdout, (name, out.stdout)
        assert re.search(r"^step\s+9/12", out.stdout, re.M), (name, out.stdout)
    # Same world: parameters, fp32 masters, AdamW state and the schedule are restored exactly.
    assert losses(resumed["same"])[1] == expected
    # One process, offloaded: the same global batches, summed in another order (bf16 rounding).
    assert losses(resumed["elastic"])[1] == pytest.approx(expected, rel=1e-2)
    assert "world 1" in resumed["elastic"].stdout


def _digest(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    match = re.search(r"^state sha256 ([0-9a-f]{64})$", out.stdout, re.M)
    assert match, out.stdout
    return match.group(1)


def _workers(parent: int) -> list[int]:
    """Process ids whose parent is ``parent`` (torchrun's workers), from ``/proc``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return sorted(found)


def _kill_one_worker_after(line: str, script: str, *args: str, nproc: int) -> tuple[int, str]:
    """Start ``torchrun``, SIGKILL its last worker once ``line`` is printed (a preempted node)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(_free_port()), str(EXAMPLES / script), *args,
    ]  # fmt: skip
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ENV)
    seen = []
    assert job.stdout is not None
    for text in job.stdout:
        seen.append(text)
        if line in text:
            workers = _workers(job.pid)
            assert len(workers) == nproc, workers
            os.kill(workers[-1], signal.SIGKILL)
            break
    rest = job.communicate(timeout=240)[0]
    return job.returncode, "".join(seen) + rest


@pytest.mark.skipif(not HAS_CHECKPOINT, reason="zeroplan.facade.checkpoint has not landed")
def test_deterministic_run_killed_and_resumed_elsewhere_is_bit_identical(tmp_path):
    """--deterministic at world 4, one worker SIGKILLed after step 8 was saved, resumed at world 1:
    the final parameters and optimizer state are the bits of an uninterrupted run at world 2."""
    args = (*SHORT, "--deterministic", "--canonical-micro-batches", "8")
    whole = _digest(torchrun("train_gpt.py", *args, nproc=2))
    ckpt = tmp_path / "ckpt"
    code, output = _kill_one_worker_after(
        "saved step 8", "train_gpt.py", *args, "--ckpt-dir", str(ckpt), "--ckpt-every", "4", nproc=4
    )
    assert code != 0, output  # the job died with its worker: killed before it finished
    assert "state sha256" not in output
    resumed = torchrun("train_gpt.py", *args, "--ckpt-dir", str(ckpt), "--resume", nproc=1)
    assert "resumed from" in resumed.stdout and "at step 8" in resumed.stdout, resumed.stdout
    assert _digest(resumed) == whole


def test_bad_example_arguments_fail_before_training():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), "--resume"],
        capture_output=True,
        text=True,
        env=_ENV,
        timeout=120,
    )
    assert out.returncode == 2 and "--resume needs --ckpt-dir" in out.stderr
