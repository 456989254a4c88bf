"""Saves that do not stop training: ``checkpoint.save(..., blocking=False)`` ([Note: background saves])."""

from __future__ import annotations

import pytest
import scenarios_background

CASES = [{"stage": 2, "dtype": "bf16"}, {"stage": 3}, {"stage": 1, "dtype": "bf16"}]


def test_background_saves_change_no_result_and_hold_the_state_of_their_call(pools, tmp_path):
    for rows in pools(2).run(scenarios_background.saved_while_training, CASES, str(tmp_path)):
        for case, r in zip(CASES, rows, strict=True):
            assert r["same_training"], (case, r)
            assert r["snapshot_is_save_time"], (case, r)
            assert r["latest"] == "snapshot-00000003" and len(r["kept"]) == 3, (case, r)
            # save() returned before its slowed writes (0.2 s per file) ended; the next step ran meanwhile
            assert r["returned_first"], (case, r)
            assert r["staged"] == r["planned"] > 0, (case, r)


@pytest.mark.parametrize("how", ["wait", "next_save", "staging"])
def test_a_background_write_that_fails_on_one_rank_raises_on_every_rank(pools, tmp_path, how):
    results = pools(2).run(scenarios_background.failed_in_background, how, str(tmp_path))
    for r in results:
        assert r["error"] is not None and "No space left on device" in r["error"], r
        assert r["latest"] == "snapshot-00000001" and r["partials"] == [], r
        assert r["previous_loads"], r
        assert r["saves_again"].startswith("snapshot-"), r
    failed = "could not take its state" if how == "staging" else "could not write"
    assert f"rank 1 {failed}" in results[0]["error"], results[0]  # rank 1 raises its own error


def test_a_second_background_save_waits_for_the_first_and_both_commit(pools, tmp_path):
    for r in pools(2).run(scenarios_background.two_in_flight, str(tmp_path)):
        assert r["first_done"], r
        assert r["names"] == ("snapshot-00000001", "snapshot-00000002"), r
        assert r["latest"] == "snapshot-00000002" and r["latest_is_second"], r
