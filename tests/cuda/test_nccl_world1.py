"""The CUDA path (NCCL, bf16, fused AdamW); skipped without a GPU. Run on a GPU machine with
``python -m pytest tests/cuda``. The CPU suite never depends on these tests.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
    reason="needs a CUDA GPU and NCCL",
)

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_world_1_nccl_bf16_equals_fused_adamw():
    # A fresh process: NCCL and its default group stay out of the test process.
    out = subprocess.run(
        [sys.executable, str(HERE / "nccl_world1.py"), str(_free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["losses"] == result["ref_losses"], result
    assert result["differing"] == [], result
