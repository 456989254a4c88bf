"""The plan's ``peak_bytes`` against ``torch.cuda.max_memory_allocated`` on one GPU; skipped without CUDA.

The CPU suite checks the same plan against torch's ``MemTracker`` (tests/facade/test_peak.py).
"""

from __future__ import annotations

import pytest
from results import keep, run_script

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def check_peaks(rows: list[dict]) -> None:
    """Every configuration's steady step peak is within 1% of the plan's ``peak_bytes``."""
    off = [
        {**row, "ratio": row["measured"][-1] / row["planned"]}
        for row in rows
        if abs(row["measured"][-1] / row["planned"] - 1) > 0.01
    ]
    assert off == [], off


def test_step_peak_equals_plan_within_one_percent():
    result = run_script("peak_world1.py", timeout=600)
    keep("peak-world1", result)
    check_peaks(result["rows"])
