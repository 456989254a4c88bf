"""At most one host read of a device value per step ([Note: one host read] in ``facade/runtime/joint.py``).

Counted on CPU (``scenarios_host_reads.py``) over two steps' backward, clipping, ``step()`` and the
next forward, at stages 1-3, with a dynamic loss scale, with expert groups, and after a parameter was
written between steps. Before the verdict was read once: 4 reads per domain and step (5-6 with loss
scaling), one more per 64 Ki elements after a parameter write.
"""

from __future__ import annotations

import pytest
import scenarios_host_reads

BUDGET = 1

CASES = [
    (2, {"stage": 2}),
    (2, {"stage": 1}),
    (2, {"stage": 3}),
    (2, {"stage": 2, "dtype": "fp16", "loss_scale": "dynamic", "clip": True}),
    (2, {"stage": 1, "dtype": "bf16", "write": True}),
    (4, {"stage": 2, "experts": True, "clip": True, "loss_scale": "dynamic"}),
    (4, {"stage": 3, "experts": True}),
]


@pytest.mark.parametrize(
    ("world", "cfg"), CASES, ids=[f"w{w}-" + "-".join(map(str, c.values())) for w, c in CASES]
)
def test_a_step_reads_the_host_at_most_once(pools, world, cfg):
    for r in pools(world).run(scenarios_host_reads.per_step, cfg):
        assert len(r["counts"]) == 2
        for count in r["counts"]:
            assert sum(count.values()) <= BUDGET, count


def test_the_counter_sees_reads_zeroplan_makes(pools):
    for r in pools(2).run(scenarios_host_reads.control):
        assert sum(r.values()) >= 1 and all(
            where.startswith("facade/mechanisms/collectives.py") for where in r
        ), r
