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
] + [{"stage": 2, "mode": "whole", "overlap": False}]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_compiled_model_trains_as_ddp_does_and_compiles_nothing_after_step_two(pools, cfg):
    for r in pools(2).run(scenarios_compile.compiled, cfg, timeout=300):
        # Compiling alone moves DDP's training by 1.0e-4 to 1.9e-4 here (compiled against eager,
        # measured): inductor fuses AdamW's inputs differently, and AdamW turns tiny gradient
        # differences into whole steps. ZeroOptimizer's compiled training is within that of DDP's.
        assert r["param_err"] < max(1e-5, 2 * r["compile_noise"]), r
        # Stages 1-2 compile again once, for the parameters as gathers leave them after step 1.
        assert len(set(r["frames"][1:])) == 1, r["frames"]
        assert r["breaks"] > 0 or not cfg.get("overlap", True)
