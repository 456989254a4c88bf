"""The whole step with traced activations on one GPU (issue 30, item 4); skipped without a GPU."""

from __future__ import annotations

import pytest
from results import keep, run_script

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
    reason="needs a CUDA GPU and NCCL",
)


def test_the_traced_step_is_within_three_percent_of_max_memory_allocated():
    results = run_script("trace_world1.py", timeout=400)
    keep("trace-world1", results)
    # Measured on an H100 (2026-11-26): stages 1-2 0.07% to 0.75% over the plan (the caching allocator's
    # rounding); stage 3, then an upper bound, 3.2% and 5.3% under it. The trace now holds stage 3's
    # blocks itself ([Note: stage 3 traced]), exact on CPU; not run on a GPU since.
    for r in results:
        assert r["exact"] and abs(r["ratio"] - 1) <= 0.03, r
