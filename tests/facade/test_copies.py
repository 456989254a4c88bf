"""Copy launches per step (issue 32): a parameter cut into several pieces of a bucket, and a shard of
many pieces, are copied by one ``_foreach_copy_`` each, not one ``copy_`` per piece.

World 4, stage 2, interleaved with 1 KiB buckets (56 buckets, 56 pieces per rank): before, 251
``copy_`` per step; after, at most one launch per (parameter, bucket) pair and per bucket.
"""

from __future__ import annotations

import scenarios_copies


def test_a_step_launches_a_copy_per_parameter_and_bucket_not_per_piece(pools):
    for r in pools(4).run(scenarios_copies.copies_per_step, {"stage": 2, "bucket_bytes": 1024}):
        launches = sum(n for name, n in r["calls"].items() if "copy" in name)
        assert r["pieces"] > r["params"], r  # a shard of more pieces than parameters
        assert launches <= r["param_buckets"] + r["buckets"] + 8, r
