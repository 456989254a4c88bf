"""Checkpoints saved with the rank-major buffer layout (commit f060ace) still load, bit for bit.

The fixtures under ``data/`` ([Note: old checkpoint fixtures] in ``scenarios_old_checkpoints.py``)
were saved at world 2 by ``ZeroOptimizer(AdamW)`` over fp32 and bf16 (stage 2) or fp16 (stage 1,
dynamic loss scale) parameters in two param groups, one of them frozen. Each is loaded, through
the public API only, into a fresh optimizer: at the saving world and settings, and at other worlds,
shard-group sizes, strategies, bucket sizes and alignments. The parameters and the consolidated
optimizer state must equal what the saving job held, bit for bit, and one more step must equal
``torch.optim.AdamW`` restored from that consolidated state, given the same gradients.
"""

from __future__ import annotations

import hashlib

import pytest
import scenarios_old_checkpoints as old

FP32_TOL = 1e-6

SHA256 = {
    "rank_major_v1/latest": "5162a9bbb39bfb0393b2fc56d3f14c3be1e5d805263efaeba68ca7d80a62a6db",
    "rank_major_v1/snapshot-00000001/frozen.pt": (
        "dcc617f2f98d000a37a06571a0a59b829151be0bc5989442d6231e2610702132"
    ),
    "rank_major_v1/snapshot-00000001/manifest.json": (
        "154b469c21b9db511e17f2dec86281a7ff2366c871769c289b4ef47a771193c5"
    ),
    "rank_major_v1/snapshot-00000001/shard-00000.pt": (
        "255182c2b42cecf1e3055db3ed371c348b448dea285025f928e6a6589fc44bde"
    ),
    "rank_major_v1/snapshot-00000001/shard-00001.pt": (
        "1f36ea5bdce81f158b5c09343e7ec3f5fadba242a9416b38dae4afa22c137715"
    ),
    "rank_major_v1_expected.pt": "8e50aac340c138d8baee4be92e61dd0323ba9bbc88d77ee0721b172c042b5324",
    "rank_major_v1_fp16/latest": "5162a9bbb39bfb0393b2fc56d3f14c3be1e5d805263efaeba68ca7d80a62a6db",
    "rank_major_v1_fp16/snapshot-00000001/frozen.pt": (
        "dcc617f2f98d000a37a06571a0a59b829151be0bc5989442d6231e2610702132"
    ),
    "rank_major_v1_fp16/snapshot-00000001/manifest.json": (
        "1ae6c53dbec32279c06288e3783ec83ea94b1b1c1b9cc6fc4b92e0e4dd0beeae"
    ),
    "rank_major_v1_fp16/snapshot-00000001/shard-00000.pt": (
        "050bc298a398fde0496882f18e68f1db39cba02911e4acde59c9d12a3bdcb88f"
    ),
    "rank_major_v1_fp16/snapshot-00000001/shard-00001.pt": (
        "15b6132661d39e40ccf19cf458748080952715211e854d1ff697bfd5f5087ea8"
    ),
    "rank_major_v1_fp16_expected.pt": "61f8350bb88a702d24dd609ffe2bd8b0de056c3745f867566b0a1e7c16b7ab75",
}
"""The fixtures as captured: a fixture rewritten by later code would no longer test old checkpoints."""

LOADS = [
    pytest.param(2, {}, id="saved-world-and-settings"),
    pytest.param(1, {}, id="world1"),
    pytest.param(4, {"shard_group_size": 2}, id="world4-shard2x2"),
    pytest.param(
        4,
        {"strategy": "lpt_whole", "bucket_bytes": 4096, "alignment": 16},
        id="world4-lpt_whole-other-buckets",
    ),
]


def test_fixtures_are_the_ones_captured_with_the_rank_major_layout():
    found = {
        str(path.relative_to(old.DATA)): hashlib.sha256(path.read_bytes()).hexdigest()
        for name in old.FIXTURES
        for path in old.fixture_files(name)
    }
    assert found == SHA256, (
        "the rank-major checkpoint fixtures changed: they are the checkpoints an earlier layout wrote "
        "and must stay as they were captured (add new fixtures under new names instead)"
    )


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The fixtures' checkpoint directories, copied: loading never touches the committed files."""
    into = tmp_path_factory.mktemp("old_checkpoints")
    return {name: str(old.copy_fixture(name, into)) for name in old.FIXTURES}


@pytest.mark.parametrize("name", list(old.FIXTURES))
@pytest.mark.parametrize(("world", "overrides"), LOADS)
def test_rank_major_checkpoint_loads_bit_exactly_and_trains_on(pools, copies, name, world, overrides):
    results = pools(world).run(old.load_and_step, name, copies[name], overrides)
    for rank, r in enumerate(results):
        assert r["params"] == [], (rank, r["params"])
        assert r["extra"] == old.EXTRA
        assert r["loss_scale"][0] == r["loss_scale"][1]
        assert r["scaler"][0] == r["scaler"][1]
        assert not r["skipped"]
    r = results[0]
    assert r["consolidated"] == [], r["consolidated"]

    # The next step: gradients reduced to the exact average (to the rounding of the sum, in the
    # model's dtype for low-precision parameters), then the step of unsharded AdamW on them.
    assert r["grad_errors"].keys() == r["master_errors"].keys() - {"shift"}
    for param, error in r["grad_errors"].items():
        bound = 8 * r["low_eps"] if param in r["low_names"] else FP32_TOL
        assert error <= bound, (param, error, r["grad_errors"])
    assert max(r["master_errors"].values()) < FP32_TOL, r["master_errors"]
    assert r["master_errors"]["shift"] == 0.0  # frozen: restored, untouched
    assert r["low_param_errors"].keys() == set(r["low_names"])
    assert max(r["low_param_errors"].values()) <= r["low_eps"], r["low_param_errors"]
    assert r["state_keys"][0] == r["state_keys"][1]
    assert max(r["state_errors"].values()) < FP32_TOL, r["state_errors"]
    assert all(ours == ref == old.STEPS_BEFORE_SAVE + 1 for ours, ref in r["steps"].values()), r["steps"]
