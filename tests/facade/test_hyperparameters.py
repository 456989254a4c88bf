"""Hyper-parameter comparison across ranks (construction agreement and the per-step digest)."""

from __future__ import annotations

import torch

from zeroplan.facade.state.inner import comparable_hyperparameters, hyperparameter_digest


class _Opaque:
    """An object whose repr holds its address, which differs between processes."""


def test_digest_sees_values_not_objects():
    a = [{"params": [torch.zeros(1)], "lr": 0.1, "betas": (0.9, 0.99), "obj": _Opaque()}]
    b = [{"params": [torch.ones(3)], "lr": 0.1, "betas": (0.9, 0.99), "obj": _Opaque()}]
    assert hyperparameter_digest(a) == hyperparameter_digest(b)  # tensors in params and addresses ignored
    b[0]["lr"] = 0.2
    assert hyperparameter_digest(a) != hyperparameter_digest(b)
    b[0]["lr"] = 0.1
    b[0]["betas"] = [0.9, 0.99]  # a list is not a tuple
    assert hyperparameter_digest(a) != hyperparameter_digest(b)


def test_tensor_settings_compare_by_value():
    a = comparable_hyperparameters([{"params": [], "lr": torch.tensor(0.1)}])
    assert a == comparable_hyperparameters([{"params": [], "lr": torch.tensor(0.1)}])
    assert a != comparable_hyperparameters([{"params": [], "lr": torch.tensor(0.2)}])
    assert 0 <= hyperparameter_digest([{"params": [], "lr": 1.0}]) < 2**62
