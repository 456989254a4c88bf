"""``torch.compile`` at stages 1-3 (issue 29, item 1; [Note: hooks under torch.compile]).

A model compiled whole or per block trains with ``ZeroOptimizer`` as DDP + AdamW trains the same
compiled model (within what compiling moves DDP's own training), and nothing is compiled again
after the second step: zeroplan's hooks and the parameters' first-use waits run between graphs
(``torch.compiler.disable``), so the blocks' state never enters a guard. Before that, a model
compiled whole at stage 3 traced the hooks and recompiled them every step up to dynamo's limit
(over 600 s for six steps of a tiny model, against 3 s now).
"""

from __future__ import annotations

import pytest
import scenarios_compile

CASES = [
    {"stage": stage, "mode": mode, **extra}
    for stage in (2, 3, 1)
    for mode in ("whole", "block")
    for extra in ({},)
] + [{"stage": 2, "mode": "whole", "overlap": False}, {"stage": 3, "mode": "block", "attach_first": True}]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_compiled_model_trains_as_ddp_does_and_compiles_nothing_after_step_two(pools, cfg):
    for r in pools(2).run(scenarios_compile.compiled, cfg, timeout=300):
        # Compiling alone moves DDP's training by 1.0e-4 to 1.9e-4 here (compiled against eager,
        # measured): inductor fuses AdamW's inputs differently, and AdamW turns tiny gradient
        # differences into whole steps. ZeroOptimizer's compiled training is within that of DDP's.
        assert r["param_err"] < max(1e-5, 2 * r["compile_noise"]), r
        # Stages 1-2 compile again once, for the parameters as gathers leave them after step 1.
        assert len(set(r["frames"][1:])) == 1, r["frames"]
        # Graph breaks: none in blocks compiled, then attached; compiled whole (or attached before
        # compiling), one where each gathered block is first read (measured: 7 at stage 2, 9 at
        # stage 1, 8 at stage 3 for this two-layer model), none without overlapped gathers.
        if cfg["mode"] == "block" and not cfg.get("attach_first"):
            assert r["breaks"] == 0, r
        else:
            assert r["breaks"] > 0 or not cfg.get("overlap", True), r


@pytest.mark.parametrize("cfg", [{"stage": 2}, {"stage": 3}, {"stage": 1, "layout": "interleaved"}], ids=str)
def test_reductions_overlap_backward_compiled_as_in_eager(pools, cfg):
    """The buckets' reductions start while backward still has graphs to run, as many compiled (whole
    or per block) as in eager mode: all but the last bucket here."""
    eager = pools(2).run(scenarios_compile.overlap, {**cfg, "mode": "eager"}, timeout=300)
    assert eager[0]["reductions"] == eager[0]["buckets"] > 2
    assert eager[0]["overlapped"] >= eager[0]["reductions"] - 1, eager[0]
    for mode in ("block", "whole"):
        compiled = pools(2).run(scenarios_compile.overlap, {**cfg, "mode": mode}, timeout=300)
        for r, e in zip(compiled, eager, strict=True):
            assert r["reductions"] == e["reductions"] and r["overlapped"] == e["overlapped"], (mode, r, e)
            assert r["graphs"] < e["graphs"]  # compiled: fewer autograd nodes (each graph is one)


def test_one_graph_would_reduce_only_after_backward(pools):
    """The control: compiled whole with no gather to wait for mid-forward (no graph break), the
    backward is one node, and every reduction starts after it. Why the breaks are kept."""
    for r in pools(2).run(
        scenarios_compile.overlap, {"stage": 2, "mode": "whole", "gather_overlap": False}, timeout=300
    ):
        assert r["breaks"] == 0 and r["reductions"] == r["buckets"], r
        assert r["overlapped"] == 0, r


@pytest.mark.parametrize("stage", [3, 2])
def test_fullgraph_says_why_and_what_to_do_and_works_per_block(pools, stage):
    for r in pools(2).run(scenarios_compile.fullgraph, {"stage": stage}, timeout=300):
        assert "zeroplan runs this between compiled graphs" in r["error"], r["error"][:2000]
        assert "compile each block, then call opt.attach(model)" in r["error"]
