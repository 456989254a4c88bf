"""``torch.compile`` and torchao's low-bit AdamW on one GPU with NCCL (issue 29); skipped without a GPU.
The figures each run measures go to ``$ZEROPLAN_CUDA_OUT`` (``results.py``)."""

from __future__ import annotations

import pytest
from results import keep, run_script

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
    reason="needs a CUDA GPU and NCCL",
)


def _run(case: str) -> dict:
    result = run_script("modern_world1.py", case, timeout=400)
    keep(f"modern-{case}", result)
    return result


def test_blocks_compiled_then_attached_train_as_adamw_with_no_break_or_recompile():
    result = _run("compile")
    for name, r in result.items():
        assert r["differing"] == 0 and r["losses_equal"], (name, r)
        assert len(set(r["frames"][1:])) == 1, (name, r)
        assert r["breaks"] == 0, (name, r)


def test_torchao_adamw8bit_equals_torchao_unsharded_and_its_state_is_planned():
    pytest.importorskip("torchao.optim")
    for name, r in _run("lowbit").items():
        assert r["differing"] == 0, (name, r)
        # The caching allocator rounds each tensor up to 512 bytes (the ``step`` scalars): 396 bytes over
        # the plan's 3.84 MB on an H100. The CPU tests compare exactly.
        assert abs(r["measured_state"] - r["planned_state"]) <= 0.01 * r["planned_state"], (name, r)
        assert r["quantized"] > 0, (name, r)


def test_cpu_offload_trains_as_without_it_with_less_device_memory():
    """[Note: offload, executed] on a GPU: pinned host buffers, copies on the side stream, the step on
    the CPU. CPU and CUDA fused AdamW may round differently: parameters within bf16's resolution."""
    for name, r in _run("offload").items():
        plain, moved = r["plain"], r["offload"]
        assert r["max_rel_error"] < 2e-2, (name, r)
        assert abs(moved["losses"][-1] - plain["losses"][-1]) < 1e-2 * abs(plain["losses"][-1]), (name, r)
        assert moved["planned_host"] > 0 and plain["planned_host"] == 0, (name, r)
        # What the plan moves to the host leaves the device (activations are in both peaks alike).
        saved = plain["planned_device_peak"] - moved["planned_device_peak"]
        assert plain["peak"] - moved["peak"] >= 0.8 * saved > 0, (name, r)
        # The host waits for the gradients' copies, and clipping reads its norm there: at most two
        # more synchronisations per step than without offload.
        assert moved["syncs"] <= plain["syncs"] + 2, (name, r)


def test_background_saves_beside_the_gpu_change_nothing_and_stage_pinned_planned_bytes():
    """[Note: background saves] on a GPU: staging pinned, copies on the side stream, training as without."""
    for name, r in _run("background").items():
        # Bit-identical where the kernels are deterministic (the CPU suite, one thread per rank); here
        # two runs of the model may differ by the embedding backward's atomics alone.
        assert r["snapshot_is_save_time"] and (r["same_training"] or r["max_rel_error"] < 2e-2), (name, r)
        assert r["pinned"] is True and r["staged"] == r["planned"] > 0, (name, r)
