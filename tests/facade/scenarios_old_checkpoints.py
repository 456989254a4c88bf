"""Checkpoints written by an earlier buffer layout keep loading: the model, its settings and the checks.

[Note: old checkpoint fixtures]
``tests/facade/data/rank_major_v1*/`` are checkpoints saved once, at world 2, by
``tests/facade/data/make_rank_major_checkpoint.py`` while the flat buffers were
*rank-major* (each shard rank's region contiguous in the full buffer). Next to each
one, ``<name>_expected.pt`` holds what the saving job held right after saving: the
model's ``state_dict()`` and ``consolidated_state_dict()``. They are data from the
past, not outputs of today's code: regenerating them with a later layout would make
``test_old_checkpoints.py`` compare the new code with itself, so the test pins their
sha256 digests.

Only the public API is used (``ZeroOptimizer`` methods, ``checkpoint.save/load``), so
these checks keep meaning the same thing whatever the internal layout becomes. What
the fixtures depend on is defined here and must not change: ``MixedMLP`` (parameter
names, shapes, dtypes, order), ``param_groups`` (membership and order) and the
settings in ``FIXTURES``. Initial values, data and the settings a test loads with
are free to change.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroplan.core import ScalerConfig
from zeroplan.facade import ZeroOptimizer, checkpoint

DATA = Path(__file__).resolve().parent / "data"
SAVED_WORLD = 2
STEPS_BEFORE_SAVE = 3
EXTRA = {"step": STEPS_BEFORE_SAVE, "fixture": "rank_major_v1"}

FIXTURES: dict[str, dict[str, Any]] = {
    # bf16 and fp32 parameters, optimizer state and gradients sharded.
    "rank_major_v1": {"low": "bf16", "stage": 2, "loss_scale": None, "bucket_bytes": 512, "alignment": 8},
    # fp16 and fp32 parameters, optimizer state sharded, a dynamic loss scale.
    "rank_major_v1_fp16": {
        "low": "fp16",
        "stage": 1,
        "loss_scale": "dynamic",
        "bucket_bytes": 512,
        "alignment": 8,
    },
}
"""Per fixture: the dtype of the low-precision parameters and the ``ZeroOptimizer`` settings it was
saved with (AdamW, world 2, one shard group, strategy "auto", which chose "flat_even": the two
largest parameters are split between the ranks; 13 gradient buckets)."""

SCALER = ScalerConfig(initial_scale=2.0**10, growth_interval=2)
"""The dynamic loss scale of the fp16 fixture (it grows once in the three steps before saving)."""

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
DECAY = {"lr": 1e-2, "weight_decay": 0.1}
NO_DECAY = {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.85, 0.99)}


class MixedMLP(nn.Module):
    """fp32 outer layers around a low-precision middle layer, and one frozen fp32 parameter.

    Odd sizes (37) leave padding in the shards; 2,304 parameters in all.
    """

    def __init__(self, low: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.low = low

        def param(*shape: int, dtype: torch.dtype = torch.float32, trainable: bool = True) -> nn.Parameter:
            values = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
            return nn.Parameter(values.to(dtype), requires_grad=trainable)

        self.w_in = param(40, 12)
        self.b_in = param(40)
        self.shift = param(40, trainable=False)
        self.w_mid = param(37, 40, dtype=low)
        self.b_mid = param(37, dtype=low)
        self.gain = param(37, dtype=low)
        self.w_out = param(5, 37)
        self.b_out = param(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w_in.t() + self.b_in + self.shift)
        h = torch.tanh(h.to(self.low) @ self.w_mid.t() + self.b_mid) * self.gain
        return h.float() @ self.w_out.t() + self.b_out


def param_groups(model: MixedMLP) -> list[dict[str, Any]]:
    """Weights with weight decay, then biases, gains and the frozen shift without (other betas too)."""
    m = model
    return [
        {"params": [m.w_in, m.w_mid, m.w_out], **DECAY},
        {"params": [m.b_in, m.shift, m.b_mid, m.gain, m.b_out], **NO_DECAY},
    ]


def ordered_names(model: MixedMLP) -> list[str]:
    """Parameter names in the optimizer's order (torch's integer ids in state dicts)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in param_groups(model) for p in g["params"]]


def build(name: str, seed: int = 0) -> MixedMLP:
    return MixedMLP(LOW[FIXTURES[name]["low"]], seed=seed)


def make_optimizer(model: MixedMLP, name: str, **overrides: Any) -> ZeroOptimizer:
    """The optimizer of fixture ``name``; ``overrides`` change ``ZeroOptimizer`` settings."""
    settings = {k: v for k, v in FIXTURES[name].items() if k != "low"}
    settings.update(overrides)
    if settings["loss_scale"] == "dynamic":
        settings.setdefault("scaler", SCALER)
    return ZeroOptimizer(param_groups(model), torch.optim.AdamW, **settings, **DECAY)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(6, 12, generator=g), torch.randn(6, 5, generator=g)


def loss_of(model: MixedMLP, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def fixture_files(name: str) -> list[Path]:
    """Every file of fixture ``name``: its checkpoint directory and its expected values."""
    return [*sorted(p for p in (DATA / name).rglob("*") if p.is_file()), DATA / f"{name}_expected.pt"]


def copy_fixture(name: str, into: Path) -> Path:
    """A copy of fixture ``name``'s checkpoint directory (loads never touch the committed one)."""
    return Path(shutil.copytree(DATA / name, into / name))


# --------------------------------------------------------------------------- comparisons
def bitwise_differences(expected: Any, actual: Any, where: str = "") -> list[str]:
    """Where ``actual`` differs from ``expected``: tensors bit for bit (dtype, shape, bytes)."""
    if torch.is_tensor(expected):
        if not torch.is_tensor(actual):
            return [f"{where}: a tensor was expected, got {type(actual).__name__}"]
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return [f"{where}: {expected.dtype}{list(expected.shape)} != {actual.dtype}{list(actual.shape)}"]
        same = torch.equal(expected.reshape(-1).view(torch.uint8), actual.reshape(-1).view(torch.uint8))
        return [] if same else [f"{where}: values differ"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or expected.keys() != actual.keys():
            got = sorted(map(str, actual)) if isinstance(actual, dict) else type(actual).__name__
            return [f"{where}: keys {sorted(map(str, expected))} != {got}"]
        return [d for k in expected for d in bitwise_differences(expected[k], actual[k], f"{where}/{k}")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            return [f"{where}: {expected!r} != {actual!r}"]
        return [
            d
            for i, (e, a) in enumerate(zip(expected, actual, strict=True))
            for d in bitwise_differences(e, a, f"{where}[{i}]")
        ]
    return (
        []
        if expected == actual and type(expected) is type(actual)
        else [f"{where}: {expected!r} != {actual!r}"]
    )


def consolidated_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """``bitwise_differences`` of two consolidated state dicts.

    Param groups are compared on the keys the saving job wrote: a later torch may add
    hyper-parameters with their defaults, which is not a change of the checkpoint.
    """
    differences = (
        [f"top-level keys {sorted(expected)} != {sorted(actual)}"] if expected.keys() != actual.keys() else []
    )
    for key in expected.keys() & actual.keys():
        if key != "param_groups":
            differences += bitwise_differences(expected[key], actual[key], key)
            continue
        if len(expected[key]) != len(actual[key]):
            differences.append(f"{len(expected[key])} param groups != {len(actual[key])}")
            continue
        for i, (e, a) in enumerate(zip(expected[key], actual[key], strict=True)):
            differences += bitwise_differences(e, {k: a.get(k) for k in e}, f"param_groups[{i}]")
    return differences


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm relative difference (in fp32)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


# --------------------------------------------------------------------------- the scenario
def _unsharded_step(
    name: str, expected: dict[str, Any], world: int, reduced: list[torch.Tensor | None]
) -> tuple[torch.optim.AdamW, list[torch.Tensor], dict[str, float]]:
    """torch.optim.AdamW restored from the expected consolidated state, one step on ``reduced``.

    Returns the reference optimizer, its (fp32) parameters after the step and, per trainable
    parameter, how far ``reduced`` is from the exact average of the ``world`` ranks' gradients.
    """
    model = build(name, seed=1)
    model.load_state_dict(expected["params"])
    names = ordered_names(model)
    by_name = dict(model.named_parameters())
    consolidated = expected["consolidated"]
    masters = consolidated.get("zeroplan_master", {})
    ref_params = [
        (masters[i] if i in masters else by_name[n].detach())
        .float()
        .clone()
        .requires_grad_(by_name[n].requires_grad)
        for i, n in enumerate(names)
    ]
    split = len(param_groups(model)[0]["params"])
    ref = torch.optim.AdamW([{"params": ref_params[:split]}, {"params": ref_params[split:]}], lr=123.0)
    ref.load_state_dict(consolidated)  # hyper-parameters too: lr=123.0 must not survive
    # The exact average of the ranks' gradients: backward in the parameters' own dtypes and of the
    # loss times the loss scale, as on each rank (a power of two: unscaling is exact).
    scale = expected["loss_scale"]
    exact = [torch.zeros(p.shape) for p in ref_params]
    for r in range(world):
        model.zero_grad(set_to_none=True)
        (loss_of(model, STEPS_BEFORE_SAVE, r) * scale).backward()
        for acc, n in zip(exact, names, strict=True):
            if by_name[n].grad is not None:
                acc += by_name[n].grad.float() / (world * scale)
    grad_errors = {
        n: rel_err(g, e)
        for n, g, e in zip(names, reduced, exact, strict=True)
        if by_name[n].requires_grad and g is not None
    }
    for p, g in zip(ref_params, reduced, strict=True):
        p.grad = None if g is None else g.clone()
    ref.step()
    return ref, [p.detach() for p in ref_params], grad_errors


def load_and_step(rank: int, world: int, name: str, root: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Load fixture ``name`` (a copy at ``root``) with ``overrides``, compare, then train one step.

    Every rank returns the differences of its parameters from the expected ones (bit for bit),
    the ``extra``, loss scale and scaler it loaded and whether its next step was skipped; rank 0
    also the differences of the consolidated state and, for the next step against unsharded
    AdamW restored from the expected consolidated state on the same gradients, the relative
    errors per parameter name of the reduced gradients, the fp32 masters (fp32 parameters
    themselves) and the low-precision parameters, and of the optimizer state.
    """
    expected = torch.load(DATA / f"{name}_expected.pt", weights_only=True)
    model = build(name, seed=1)  # other initial values: everything must come from the checkpoint
    opt = make_optimizer(model, name, **overrides)
    extra = checkpoint.load(opt, root)
    result: dict[str, Any] = {
        "extra": extra,
        "params": bitwise_differences(expected["params"], model.state_dict(), "params"),
        "loss_scale": (opt.loss_scale, expected["loss_scale"]),
        "scaler": (None if opt.scaler_state is None else opt.scaler_state.as_dict(), expected["scaler"]),
    }
    consolidated = opt.consolidated_state_dict(to_rank=0)
    if rank == 0:
        result["consolidated"] = consolidated_differences(expected["consolidated"], consolidated)

    # One more step, compared with unsharded AdamW restored from the expected consolidated state.
    opt.backward(loss_of(model, STEPS_BEFORE_SAVE, rank))
    reduced = opt.averaged_gradients()
    opt.step()
    result["skipped"] = opt.last_step_skipped
    opt.zero_grad()
    after = opt.consolidated_state_dict(to_rank=0)
    if rank != 0:
        return result
    ref, ref_params, grad_errors = _unsharded_step(name, expected, world, reduced)
    names = ordered_names(model)
    by_name = dict(model.named_parameters())
    masters = after.get("zeroplan_master", {})
    ours = [masters[i] if i in masters else by_name[n].detach() for i, n in enumerate(names)]
    ref_state = ref.state_dict()["state"]
    result.update(
        low_names=sorted(n for n, p in by_name.items() if p.dtype != torch.float32),
        low_eps=torch.finfo(model.low).eps,
        grad_errors=grad_errors,
        master_errors={n: rel_err(a, b) for n, a, b in zip(names, ours, ref_params, strict=True)},
        low_param_errors={
            n: rel_err(by_name[n], r.to(model.low))
            for n, r in zip(names, ref_params, strict=True)
            if by_name[n].dtype == model.low
        },
        state_keys=(
            {i: sorted(entry) for i, entry in after["state"].items()},
            {i: sorted(entry) for i, entry in ref_state.items()},
        ),
        state_errors={
            f"{names[i]}/{k}": rel_err(after["state"][i][k], v)
            for i, entry in ref_state.items()
            for k, v in entry.items()
            if k != "step" and i in after["state"]
        },
        steps={
            names[i]: (float(after["state"][i]["step"]), float(entry["step"]))
            for i, entry in ref_state.items()
            if i in after["state"]
        },
    )
    return result
