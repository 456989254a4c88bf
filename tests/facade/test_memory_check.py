"""``ZeroOptimizer`` compares the plan's peak with the device's free memory at construction
([Note: device memory check]). CPU is not checked, so these tests replace the free-memory probe."""

from __future__ import annotations

import pytest
import scenarios_memory_check


def test_a_peak_that_fits_says_nothing(pools):
    for r in pools(2).run(scenarios_memory_check.construct, {"free": 2**40, "short_rank": 0, "strict": True}):
        assert r == {"error": None, "warnings": [], "unchanged": True}


@pytest.mark.parametrize(
    ("free", "advice", "settings"),
    [
        # 64 KiB free: nothing fits on the device without offload (the parameters alone are 120 KiB
        # in fp32, its shard of them 60), the optimizer's fp32 buffers in host memory do, and a
        # quarter of them can stay on the device ([Note: kept on the device]).
        (2**16, "stage 2 with shard groups of 2, offload optimizer (offload_fraction=0.75) would fit", {}),
        (2**12, "no stage 1 or 2 configuration fits", {}),  # 4 KiB: nothing does
        # The user's own offload fraction is not carried into the advice (it was, without its mode).
        (
            2**16,
            "offload optimizer (offload_fraction=0.75) would fit",
            {"offload": "optimizer"} | {"offload_fraction": 0.1},
        ),
    ],
)
def test_strict_raises_on_every_rank_when_one_rank_is_short(pools, free, advice, settings):
    cfg = {"free": free, "short_rank": 1, "strict": True, "settings": settings}
    results = pools(2).run(scenarios_memory_check.construct, cfg)
    for r in results:
        assert r["error"] is not None and r["unchanged"], r
        assert "rank 1: the plan's peak is" in r["error"], r["error"]
        assert "strict_memory=True" in r["error"]
        assert "the largest part is the" in r["error"]
        assert advice in r["error"], r["error"]


def test_without_strict_the_short_rank_warns_and_training_goes_on(pools):
    # 128 KiB free: stage 1 with the default (for-loop) AdamW does not fit, something else does.
    cfg = {"free": 2**17, "short_rank": 0, "strict": False}
    results = pools(2).run(scenarios_memory_check.construct, cfg)
    assert results[0]["error"] is None and len(results[0]["warnings"]) == 1
    assert results[1] == {"error": None, "warnings": [], "unchanged": True}
    message = results[0]["warnings"][0]
    assert message.startswith("rank 0: the plan's peak is"), message
    assert "would fit, with a planned peak of" in message, message


def test_an_unexpected_error_on_one_rank_raises_on_every_rank_without_waiting(pools):
    # Not a ZeroplanError: the plan agreement still reports it to the other rank at once.
    cfg = {"free": "raise", "short_rank": 1, "strict": True}
    results = pools(2).run(scenarios_memory_check.construct, cfg)
    assert results[1]["error"] == "RuntimeError: the free-memory probe failed"
    assert results[0]["error"].startswith("ConfigError: rank 1 rejected the optimizer settings: RuntimeError")
    assert all(r["unchanged"] for r in results)


def test_memory_the_caching_allocator_holds_unused_counts_as_free(monkeypatch):
    import torch

    from zeroplan.facade.diagnostics import memory_check

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 9 << 30)
    assert memory_check.free_bytes(torch.device("cuda", 0)) == (5 + 3) << 30
    assert memory_check.free_bytes(torch.device("cpu")) is None
