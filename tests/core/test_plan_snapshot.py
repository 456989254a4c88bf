"""Plans and memory reports are what they were: fingerprints, reports and plan values of about a
hundred configurations against ``data/plan_snapshot.json`` (see [Note: plan snapshot] in
``plan_snapshot.py``; a change that means to change plans rewrites the file with ``write``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plan_snapshot

SNAPSHOT = Path(__file__).parent / "data" / "plan_snapshot.json"


def test_plans_and_reports_match_the_snapshot():
    saved = json.loads(SNAPSHOT.read_text())
    assert saved["set"] == "small" and len(saved["entries"]) >= 100
    assert plan_snapshot.mismatches("small", saved["entries"]) == []


def test_the_snapshot_covers_what_it_says():
    configs = plan_snapshot.configurations("small")
    assert {c["stage"] for c in configs} == {0, 1, 2, 3}
    assert {c["layout"] for c in configs} == {"auto", "interleaved", "rank_major"}
    assert {c["strategy"] for c in configs} >= {"flat_even", "lpt_whole", "greedy_whole"}
    assert max(c["world"] for c in configs) == 4096 and any(c["shard_size"] < c["world"] for c in configs)
    assert {c["model"][0] for c in configs} == {"preset", "random"}
    entries = json.loads(SNAPSHOT.read_text())["entries"]
    assert 0 < sum("error" in e for e in entries) < 10  # refusals are pinned too, but few
