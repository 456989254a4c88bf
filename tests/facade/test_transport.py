"""Which plans a backend can carry for tensors on a device (``construction.check_transport``)."""

from __future__ import annotations

import pytest

from zeroplan.core import ConfigError, Topology, plan, specs_from_shapes
from zeroplan.facade.runtime.construction import check_transport

SPECS = specs_from_shapes([(17, 257), (64,)])


@pytest.mark.parametrize(
    ("stage", "layout", "policy", "backend", "devices", "refused"),
    [
        (2, "auto", "gloo", "gloo", {"cpu"}, None),  # exchanges of CPU tensors: what gloo does best
        (2, "auto", "gloo", "gloo", {"cuda"}, "carry CPU tensors only"),
        (3, "auto", "gloo", "gloo", {"cuda"}, "carry CPU tensors only"),
        (2, "auto", "gloo", "nccl", {"cuda"}, "could deadlock"),
        (1, "rank_major", "gloo", "gloo", {"cuda"}, None),  # all-reduce and broadcasts only
        (2, "rank_major", "gloo", "gloo", {"cuda"}, None),  # broadcasts of chunks ([Note: gather blocks])
        (1, "rank_major", "gloo", "nccl", {"cuda"}, None),
        (2, "auto", "min_bytes", "nccl", {"cuda"}, None),
    ],
)
def test_exchanges_need_gloo_and_cpu_tensors(stage, layout, policy, backend, devices, refused):
    zp = plan(SPECS, Topology(world_size=2), stage=stage, layout=layout, policy=policy)
    if refused is None:
        check_transport(zp, backend, devices)
    else:
        with pytest.raises(ConfigError, match=refused):
            check_transport(zp, backend, devices)


def test_a_shard_group_of_one_exchanges_nothing():
    zp = plan(SPECS, Topology(world_size=2, shard_size=1), stage=2, policy="gloo")
    check_transport(zp, "nccl", {"cuda"})


def test_nccl_needs_the_parameters_on_the_current_device(monkeypatch):
    import torch

    from zeroplan.facade.runtime.construction import check_current_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    check_current_device("nccl", torch.device("cuda", 0))
    check_current_device("gloo", torch.device("cuda", 1))  # gloo's object collectives use the CPU
    check_current_device("nccl", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"torch.cuda.set_device\(1\)"):
        check_current_device("nccl", torch.device("cuda", 1))
