"""The interleaved layout and the overlapped parameter gather on gloo (issue 12).

* Overlapping the gather never changes a result: a model read right after ``step()`` (raw values,
  ``state_dict()``, an EMA update, a forward) equals the same model trained with
  ``overlap_param_gather=False``, bit for bit, and the gathers really are left in flight by
  ``step()`` (parameters are ``GatheringParameter`` until first used).
* Interleaved buckets are reduced by ``reduce_scatter`` and gathered by ``all_gather`` only (plus the
  replica all-reduce with shard groups) under the min_bytes policy.
* Checkpoints move between layouts and shard sizes bit-exactly.
"""

from __future__ import annotations

import pytest
import scenarios_layout

OVERLAP_CASES = [
    # (world, settings)
    (2, {"stage": 2, "collectives": "gloo"}),
    (2, {"stage": 1, "collectives": "min_bytes"}),
    (2, {"stage": 2, "dtype": "bf16", "collectives": "min_bytes"}),
    (2, {"stage": 2, "layout": "rank_major"}),
    (4, {"stage": 2, "shard": 2, "collectives": "min_bytes"}),
    (4, {"stage": 1, "dtype": "fp16", "collectives": "gloo"}),
    (2, {"stage": 2, "strategy": "lpt_whole", "collectives": "min_bytes"}),
]


@pytest.mark.parametrize(("world", "settings"), OVERLAP_CASES)
def test_overlapped_gather_is_bit_identical_and_never_read_stale(pools, world, settings):
    results = pools(world).run(scenarios_layout.overlap_against_waiting, {"steps": 4, **settings})
    for r in results:
        assert all(r["equal"]), r["equal"]  # every way of reading after step() saw the new values
        assert all(r["losses_equal"]), r["losses_equal"]
        assert all(r["deferred"]), "step() should leave the gathers in flight"
        assert r["after_forward"] is False  # the forward waited for (and restored) every parameter
        auto = "rank_major" if settings["stage"] == 1 else "interleaved"  # stage 1 reduces in place
        assert r["layout"] == settings.get("layout", auto)


@pytest.mark.parametrize("settings", [{"stage": 1}, {"stage": 2, "layout": "rank_major"}])
def test_a_rank_major_gather_lets_the_first_layers_run_before_the_rest_arrives(pools, settings):
    """[Note: gather blocks]: stage 1 (rank-major by default) gathers bucket-sized chunks, so the first
    read after step() waits for the first chunk, and later parameters are still in flight."""
    for r in pools(2).run(scenarios_layout.first_read_waits_for_its_chunk_only, settings):
        assert r["layout"] == "rank_major"
        assert all(chunks > 2 for chunks in r["chunks"]), r
        assert r["in_flight_before"] == r["params"], r
        assert not r["first_waiting_after"]
        assert 0 < r["in_flight_after"] < r["in_flight_before"], r  # only the first chunk was waited for


@pytest.mark.parametrize(("world", "shard"), [(2, None), (4, None), (4, 2)])
def test_interleaved_min_bytes_uses_one_reduce_scatter_and_one_all_gather_per_bucket(pools, world, shard):
    results = pools(world).run(
        scenarios_layout.overlap_against_waiting,
        {"steps": 1, "stage": 2, "shard": shard, "collectives": "min_bytes"},
    )
    expected = {("shard", "reduce_scatter"), ("shard", "all_gather"), ("world", "all_reduce")}  # + agreement
    if shard is not None:
        expected.add(("replica", "all_reduce"))
    for r in results:
        assert r["collectives"] == ["reduce_scatter"]
        assert set(r["comm"]) == expected, r["comm"]


@pytest.mark.parametrize(
    ("save", "load"),
    [
        (("interleaved", None), ("rank_major", 1)),
        (("rank_major", None), ("interleaved", None)),
        (("interleaved", 1), ("interleaved", None)),
    ],
)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpoints_move_between_layouts_bit_exactly(pools, save, load, dtype):
    cfg = {"save_layout": save[0], "save_shard": save[1], "load_layout": load[0], "load_shard": load[1]}
    results = pools(2).run(scenarios_layout.across_layouts, {**cfg, "dtype": dtype})
    for r in results:
        assert r["layouts"] == (save[0], load[0])
        assert r["values_equal"] and r["state_equal"]
        assert r["after_step_diff"] < 1e-6


@pytest.mark.parametrize("stage", [2, 3])
def test_nothing_is_written_onto_the_users_parameters(pools, stage):
    """[Note: residency]: which residency a parameter belongs to is kept beside it (``params.owners``),
    not as attributes on the user's tensors."""
    for r in pools(2).run(scenarios_layout.tensor_attributes, {"stage": stage}):
        assert [a for a in r["attributes"] if a.startswith("_zeroplan")] == [], r
