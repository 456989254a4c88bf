"""One torchrun launch of ``hf_runs.py`` (two ranks), shared by the Hugging Face tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_hf_runs(out: Path, runs: Sequence[str]) -> None:
    """Run ``runs`` of ``hf_runs.py`` under torchrun at world 2, results under ``out``; fail with its
    output's tail if it fails."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()), str(HERE / "hf_runs.py"), str(out), *runs,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
