"""[Note: streams] on CPU: the facade's CUDA stream ordering, run against a recording fake.

Rule 1: during backward every bucket completes on the side stream, and the compute stream waits only
for marks (before opening a bucket), never for the side stream itself; after the last bucket the
reduction's end joins the side stream back before the step reads a gradient shard. Rule 2: a first
reader on another stream makes the collective's home stream wait.
"""

from __future__ import annotations

import pytest
import scenarios_streams

from zeroplan.facade.mechanisms import collectives

CASES = [
    {"stage": 2},
    {"stage": 2, "collectives": "min_bytes"},  # reduce-scatters and all-gathers, as on NCCL
    {"stage": 1},
    {"stage": 2, "dtype": "bf16"},
    {"stage": 3},
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_buckets_complete_on_the_side_stream_and_join_before_the_step(pools, cfg):
    for r in pools(2).run(scenarios_streams.bucket_streams, cfg):
        backward, step = r["backward"], r["step"]
        assert r["buckets"] > 2
        completions = [stream for stream, what, *_ in backward if what == "completes a collective"]
        # One bucket in flight at most: the others retire during backward, on the side stream. At stage 3
        # the compute stream also completes the gathers of the blocks it is about to use.
        assert completions.count("side") >= r["buckets"] - 1, completions
        if cfg["stage"] < 3:
            assert set(completions) == {"side"}, completions
        assert ("compute", "waits for", "side") not in backward, backward  # the compute stream never blocks
        assert any(e[:2] == ("compute", "waits for mark") for e in backward), backward
        assert all(e[0] == "side" for e in backward if e[1] == "mark"), backward
        join = step.index(("compute", "waits for", "side"))
        assert all(e[0] == "side" for e in step[:join] if e[1] == "completes a collective"), step


def test_a_two_hop_gather_waits_its_first_hop_on_the_side_stream(pools):
    cfg = {"stage": 2, "collectives": "min_bytes", "ranks_per_node": 2}
    for r in pools(4).run(scenarios_streams.bucket_streams, cfg):
        step = r["step"]
        join = step.index(("compute", "waits for", "side"))  # the gradients' reduction ended
        gathers = step[join + 1 :]  # step() then starts the parameter gathers
        assert ("side", "completes a collective") in gathers, gathers  # hop 1, on the side stream
        assert ("compute", "waits for", "side") not in gathers, "\n".join(map(str, gathers))
        assert ("compute", "completes a collective") in r["forward"], r["forward"]  # hop 2, by its reader


class _Work:
    def wait(self) -> None:
        pass


def test_a_first_reader_on_another_stream_makes_the_home_stream_wait():
    with scenarios_streams.fake_cuda() as fake:
        pending = collectives.Pending(_Work(), home=fake.compute)
        with fake.stream(scenarios_streams.FakeStream("ema", fake.log)):
            pending.finish()
        assert ("compute", "waits for", "ema") in fake.log
        quiet = collectives.Pending(_Work(), home=fake.compute)
        fake.log.clear()
        quiet.finish()  # read on its own stream: nothing more to wait for
        assert fake.log == [("compute", "completes a collective")]


@pytest.mark.parametrize("cfg", [{"stage": 2, "dtype": "bf16"}, {"stage": 1}, {"stage": 3, "offload": "all"}])
def test_offloaded_copies_run_on_the_side_stream_in_bucket_order(pools, cfg):
    """[Note: offload, executed]: each bucket's sum goes to host memory on the side stream as it
    completes; the host waits once; each unit is stepped, then its copy back is queued on the side
    stream before the next unit steps; the compute stream waits for the last copy."""
    for r in pools(2).run(scenarios_streams.offload_streams, cfg):
        backward, step = r["backward"], r["step"]
        waits = [i for i, e in enumerate(step) if e == ("host", "waits for", "side")]
        assert len(waits) == 1, step  # one host synchronisation per step
        # Every bucket's copy to host memory is queued on the side stream, before the host's wait.
        down = [e for e in backward + step[: waits[0]] if e[:2] == ("side", "copies")]
        assert down == [("side", "copies", "1")] * r["to_host_copies"] and len(down) > 1, down
        assert any(e[:2] == ("side", "copies") for e in backward), backward  # during backward
        # offload="all": each block's shard piece goes up (asynchronously) before its gather, as planned.
        up = [e for e in r["forward"] + backward if e[:2] == ("compute", "copies")]
        assert len(up) == (r["to_device_copies"] if cfg.get("offload") == "all" else 0), up
        units = [i for i, e in enumerate(step) if e == ("host", "steps a unit")]
        assert len(units) == r["units"] > 1 and waits[0] < units[0], step
        ups = [i for i, e in enumerate(step) if e[:2] == ("side", "copies") and i > units[0]]
        assert len(ups) == len(units), step
        for unit, up, following in zip(units, ups, [*units[1:], len(step)], strict=True):
            assert unit < up < following, step  # copied back before the next unit steps
        join = step.index(("compute", "waits for", "side"), ups[-1])
        assert all(e[1] != "completes a collective" or e[0] == "side" for e in step[ups[-1] : join]), step
        launches = [i for i, e in enumerate(step) if e[1] == "launches a collective" and i > units[0]]
        if cfg["stage"] < 3:  # gathers start as units complete their blocks, before the last unit steps
            assert launches and launches[0] < units[-1], step
            first = launches[0]
            assert ("compute", "waits for", "side") in step[ups[0] : first], step  # after the copies
        else:  # the next forward gathers
            assert launches == [], step


def test_a_partial_offload_steps_its_kept_part_first_on_the_device(pools):
    """[Note: kept on the device]: the kept buckets' sums land on the device (on the side stream, as the
    others, which go to host memory); after the host's one wait the inner optimizer steps the kept part
    first, its values go into the parameters on the compute stream (no copy over the side stream), the
    gathers of blocks every rank kept start before the first host unit, then the units as before."""
    cfg = {"stage": 2, "dtype": "bf16", "offload_fraction": 0.5}
    for r in pools(2).run(scenarios_streams.offload_streams, cfg):
        backward, step = r["backward"], r["step"]
        assert r["kept_tensors"] > 0 and r["units"] > 1 and r["kept_blocks"] > 0, r
        waits = [i for i, e in enumerate(step) if e == ("host", "waits for", "side")]
        assert len(waits) == 1, step
        down = [e for e in backward + step[: waits[0]] if e[:2] == ("side", "copies")]
        assert len(down) == r["bucket_pieces"] > r["to_host_copies"], (down, r)  # kept ones land apart
        calls = [i for i, e in enumerate(step) if e == ("host", "steps a unit")]
        assert len(calls) == r["units"] + 1 and waits[0] < calls[0], step  # the kept call, then the units
        kept, first = calls[0], calls[1]
        assert not any(e[:2] == ("side", "copies") for e in step[kept:first]), step
        launched = [e for e in step[kept:first] if e[1] == "launches a collective"]
        assert launched, step  # the blocks every rank kept: gathered while the host steps the units
        ups = [i for i, e in enumerate(step) if e[:2] == ("side", "copies") and i > first]
        assert len(ups) == r["units"], step
        for unit, up, following in zip(calls[1:], ups, [*calls[2:], len(step)], strict=True):
            assert unit < up < following, step
