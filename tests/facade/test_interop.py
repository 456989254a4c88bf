"""Replacing DDP: ``opt.grad_norm()`` for code that logs gradients, ``broadcast_buffers`` for buffers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import scenarios_interop
import torch

TOL = 1e-6


@pytest.mark.parametrize("stage", [1, 2])
def test_grad_norm_equals_clip_grad_norm_of_the_unsharded_model(pools, stage):
    results = pools(2).run(scenarios_interop.grad_norm, stage)
    first = results[0]
    for step, (ours, ref) in enumerate(zip(first["norms"], first["ref_norms"], strict=True)):
        for norm_type, a, b in zip(scenarios_interop.NORM_TYPES, ours, ref, strict=True):
            assert abs(a - b) <= TOL * b, (step, norm_type, a, b)
    assert all(r["norms"] == first["norms"] for r in results)  # bit-identical on every rank
    for result in results:
        assert all(result["repeat_equal"]) and all(result["clip_equal"]) and all(result["not_logged"])
        assert result["after_clip"] == pytest.approx(0.01, rel=1e-4)  # the norm of the clipped gradients
        assert result["before_backward"] is not None and "grad_norm()" in result["before_backward"]
        assert result["after_step"] is not None and "before any backward" in result["after_step"]
        assert result["param_error"] < TOL
    # At stage 2 no rank holds whole gradients after backward: grad_norm() is how to read their norm.
    assert all(first["grad_is_none"]) == (stage == 2)


@pytest.mark.parametrize("stage", [1, 2])
def test_broadcast_buffers_does_what_ddp_broadcast_buffers_did(pools, stage):
    results = pools(2).run(scenarios_interop.buffers, stage)
    for result in results:
        assert result["as_ddp"] and result["params_as_ddp"]  # BatchNorm statistics and weights, bit for bit
    zero, one = results[0]["buffers"], results[1]["buffers"]
    assert all(torch.equal(zero[n], one[n]) for n in zero)  # after the last broadcast: rank 0's everywhere
    assert zero["flag"].all()  # a bool buffer (sent as bytes: gloo has no bool)
    drift = results[0]["drifting"], results[1]["drifting"]
    assert not torch.equal(drift[0]["body.1.running_mean"], drift[1]["body.1.running_mean"])


def test_the_facade_package_stays_torch_free_until_broadcast_buffers_is_used():
    code = (
        "import sys, zeroplan.facade as f\n"
        "assert 'torch' not in sys.modules\n"
        "f.broadcast_buffers\n"
        "assert 'torch' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
