"""The CUDA path (NCCL, bf16, fused AdamW); skipped without a GPU. Run on a GPU machine with
``python -m pytest tests/cuda``. The CPU suite never depends on these tests.
"""

from __future__ import annotations

import pytest
from results import run_script

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
    reason="needs a CUDA GPU and NCCL",
)


def test_world_1_nccl_bf16_equals_fused_adamw():
    result = run_script("nccl_world1.py", timeout=300)
    assert result["losses"] == result["ref_losses"], result
    assert result["differing"] == [], result
