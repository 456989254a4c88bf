"""``deterministic_world1.py`` on one GPU (NCCL), and its CPU form on gloo (which runs everywhere).

Deterministic mode with ``torch.use_deterministic_algorithms(True)``: every stage, layout, bucket
size and overlap setting ends in the same bits ([Note: deterministic mode]).
"""

from __future__ import annotations

import pytest
from results import run_script

torch = pytest.importorskip("torch")


def _run(on: str) -> dict:
    return run_script("deterministic_world1.py", on, timeout=300)


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
