"""``deterministic_world1.py`` on one GPU (NCCL), and its CPU form on gloo (which runs everywhere).

Deterministic mode with ``torch.use_deterministic_algorithms(True)``: every stage, layout, bucket
size and overlap setting ends in the same bits ([Note: deterministic mode]).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(on: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "deterministic_world1.py"), str(_free_port()), on],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
    reason="needs a CUDA GPU and NCCL",
)
def test_every_configuration_ends_in_the_same_bits_on_a_gpu():
    result = _run("cuda")
    assert result["differing"] == [], result["results"]


def test_every_configuration_ends_in_the_same_bits_on_the_cpu():
    result = _run("cpu")
    assert result["differing"] == [], result["results"]
