"""The plan's ``peak_bytes`` against ``torch.cuda.max_memory_allocated`` on one GPU; skipped without CUDA.

The CPU suite checks the same plan against torch's ``MemTracker`` (tests/facade/test_peak.py).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from results import keep

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_peaks(rows: list[dict]) -> None:
    """Every configuration's steady step peak is within 1% of the plan's ``peak_bytes``."""
    off = [
        {**row, "ratio": row["measured"][-1] / row["planned"]}
        for row in rows
        if abs(row["measured"][-1] / row["planned"] - 1) > 0.01
    ]
    assert off == [], off


def test_step_peak_equals_plan_within_one_percent():
    out = subprocess.run(
        [sys.executable, str(HERE / "peak_world1.py"), str(_free_port())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    keep("peak-world1", result)
    check_peaks(result["rows"])
