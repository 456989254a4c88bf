"""Buffers allocated where the plan places their role ([Note: residences] in ``core/residence.py``).

On the CPU host memory is the device's, so a plan with roles in host memory allocates them on the
CPU and steps bit-identically to the default plan; its report moves their bytes from the device
to the host. Beside an accelerator only offload's roles may live in host memory.
"""

from __future__ import annotations

import pytest
import scenarios_residence
import torch

from zeroplan.core import BufferRole, ConfigError, Residence, Residences, Topology, plan, specs_from_shapes
from zeroplan.facade.mechanisms.buffer_devices import BufferDevice, buffer_device

HOST = {
    1: ["full_grads", "grad_shard", "master", "staging", "optimizer_state"],
    2: ["grad_shard", "master", "staging", "optimizer_state"],
    3: ["param_shard", "grad_shard", "master", "block", "staging", "optimizer_state"],
}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_roles_in_host_memory_on_the_cpu_step_as_the_default_plan(pools, stage):
    for r in pools(2).run(
        scenarios_residence.placed_on_host_against_default, {"stage": stage, "host": HOST[stage]}
    ):
        assert all(r["equal"]), r["equal"]
        assert r["host"] == HOST[stage] and r["devices"] == ["cpu"]
        assert 0 <= r["more_state_bytes"] < 100, r
        assert r["host_bytes"] > 0
        assert r["device_bytes"] == r["default_device_bytes"] - r["host_bytes"] + r["more_state_bytes"]


def test_a_residence_is_a_device_and_host_memory_is_pinned_beside_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert (
        buffer_device(Residence.DEVICE, cpu) == buffer_device(Residence.HOST, cpu) == BufferDevice(cpu, False)
    )
    assert buffer_device(Residence.DEVICE, cuda) == BufferDevice(cuda, False)
    assert buffer_device(Residence.HOST, cuda) == BufferDevice(cpu, True)


@pytest.mark.parametrize(
    ("host", "message"),
    [
        # offload's roles may live in host memory beside a GPU; the buffers collectives run on may not
        (("staging",), "places staging in host memory beside parameters on cuda:0"),
        # the inner optimizer reads its gradients beside the masters it steps
        (("grad_shard",), "gradient shard on the host and the masters apart from it"),
    ],
)
def test_host_placements_the_step_cannot_run_beside_an_accelerator_are_refused(host, message):
    """[Note: offload, executed]: checked by ``install`` before anything is allocated."""
    from zeroplan.facade.runtime.installed import install

    zp = plan(specs_from_shapes([(8,)]), Topology(world_size=1), residences=Residences(host=host))

    class Registry:
        params, device = (), torch.device("cuda", 0)

    class Groups:
        shard_rank = 0

    with pytest.raises(ConfigError, match=message):
        install(zp, Registry(), Groups(), torch.optim.SGD, [], admit=bool, log=None)  # type: ignore[arg-type]
    assert all(zp.residences.of(BufferRole(role)) is Residence.HOST for role in host)
