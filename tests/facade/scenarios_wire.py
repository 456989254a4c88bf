"""Gradient wire formats: one reduction at world W against the exact average, traffic and memory."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model

from zeroplan.facade.checkpoint.consolidate import MASTER_KEY


def reduced_error(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The averaged gradients of one step with ``cfg["wire"]``: their largest error against the fp64
    average of every rank's own gradients, the largest gradient of any rank, and the accounting."""
    dtype = DTYPES[cfg.get("dtype", "bf16")]
    model = make_model(dtype=dtype)
    opt = make_optimizer(
        model,
        hyper={"lr": 1e-3},
        stage=cfg.get("stage", 2),
        shard=cfg.get("shard"),
        alignment=cfg.get("alignment", 16),
        bucket_bytes=cfg.get("bucket_bytes", 2048),
        reduce_dtype=cfg.get("wire"),
        wire_block=cfg.get("block", 16),
        **({"layout": cfg["layout"]} if "layout" in cfg else {}),
    )
    opt.attach(model)
    reference = make_model(dtype=dtype)
    tokens = batch(0, rank)
    own = torch.autograd.grad(loss_of(reference, *tokens), list(reference.parameters()))
    exact = torch.cat([g.double().reshape(-1) for g in own])
    largest = exact.abs().max().reshape(1)
    dist.all_reduce(exact)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    opt.backward(loss_of(model, *tokens))
    got = torch.cat([g.double().reshape(-1) for g in opt.averaged_gradients()])
    error = (got - exact / world).abs().max().item()
    opt.step()
    opt.zero_grad()
    report = opt.memory_report().ranks[opt.process_groups.rank]
    measured = opt.measured_memory()
    return {
        "error": error,
        "largest": largest.item(),
        "comm": sorted(
            (c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in opt.last_step_comm()
        ),
        "planned_comm": sorted(
            (c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in report.comm
        ),
        "measured": (
            measured.params_bytes,
            measured.grads_bytes,
            measured.master_bytes,
            measured.buffer_bytes,
        ),
        "planned": (report.params_bytes, report.grads_bytes, report.master_bytes, report.buffer_bytes),
    }


def refused_wires(rank: int, world: int, cases: list[dict[str, Any]]) -> list[str | None]:
    """Construct with each case's settings (which may differ per rank): per case, the error this rank
    raised (``None``: none). Caught here, so one pool serves every case: a refusal raises on every
    rank alike and leaves the process group usable."""
    errors: list[str | None] = []
    for cfg in cases:
        settings = cfg["per_rank"][rank] if "per_rank" in cfg else cfg
        try:
            make_optimizer(make_model(), hyper={"lr": 1e-3}, alignment=16, **settings)
            errors.append(None)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def _masters(opt: Any, *, with_state: bool = True) -> list[torch.Tensor]:
    """The consolidated fp32 masters, then (``with_state``) every tensor of the optimizer state."""
    state = opt.consolidated_state_dict(None)
    assert state is not None
    masters = state.get(MASTER_KEY, {})
    return [masters[i] for i in sorted(masters)] + [
        state["state"][i][k]
        for i in sorted(state["state"])
        for k in sorted(state["state"][i])
        if with_state and isinstance(state["state"][i][k], torch.Tensor)
    ]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def published_params(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One step with ``cfg["gather"]`` as the parameter wire next to the same step without.

    Returns the parameters' largest error against the step without the wire, the largest
    parameter, every rank's parameters (as bytes: they must be equal on every rank), whether the
    masters and state are the same bits as without the wire, the step's traffic next to the plan's,
    and what a write kept inside ``gathered_params(writeback=True)`` did to the masters.
    """
    dtype = DTYPES[cfg.get("dtype", "bf16")]
    # Stage 3 gathers through the wire before the first forward too, so its gradients differ from
    # the run without it: with lr 0 both end where they started, and the masters must not have moved.
    stage3 = cfg.get("stage", 2) == 3
    settings = {
        "hyper": {"lr": 0.0 if stage3 else 1e-2},
        "stage": cfg.get("stage", 2),
        "shard": cfg.get("shard"),
        "alignment": 16,
        "bucket_bytes": cfg.get("bucket_bytes", 2048),
        "wire_block": cfg.get("block", 16),
        "reduce_dtype": cfg.get("wire"),
        **({"layout": cfg["layout"]} if "layout" in cfg else {}),
        **({"ranks_per_node": cfg["ranks_per_node"]} if "ranks_per_node" in cfg else {}),
        **({"collectives": cfg["collectives"]} if "collectives" in cfg else {}),
        **({"overlap_param_gather": cfg["overlap"]} if "overlap" in cfg else {}),
    }
    out: dict[str, Any] = {}
    for gather in (None, cfg["gather"]):
        model = make_model(dtype=dtype)
        opt = make_optimizer(model, gather_dtype=gather, **settings)
        opt.attach(model)
        opt.backward(loss_of(model, *batch(0, rank)))
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            params = _flat(model)
        out[gather] = (model, opt, params, _masters(opt, with_state=not stage3))
    (_, _, plain, plain_masters), (model, opt, params, masters) = out[None], out[cfg["gather"]]
    report = opt.memory_report().ranks[opt.process_groups.rank]
    comm = sorted((c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in opt.last_step_comm())
    planned = sorted((c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in report.comm)

    # A write kept by gathered_params(writeback=True): only the written elements' masters move.
    first = next(iter(model.parameters()))
    with opt.gathered_params(writeback=True), torch.no_grad():
        first.view(-1)[:3] = torch.tensor([0.5, -0.25, 2.0], dtype=first.dtype)
    written = _masters(opt, with_state=not stage3)
    with opt.gathered_params():
        after_write = _flat(model)
    return {
        "error": (params - plain).abs().max().item(),
        "largest": plain.abs().max().item(),
        "params": params.numpy().tobytes(),
        "masters_exact": all(torch.equal(a, b) for a, b in zip(masters, plain_masters, strict=True)),
        "comm": comm,
        "planned_comm": planned,
        "masters_moved": sum(int((a != b).sum()) for a, b in zip(written, masters, strict=True)),
        "written_held": after_write[:3].tolist(),
        "params_moved": int((after_write != params).sum()),
    }


#: ``torch.distributed`` functions a step may call, by the collective zeroplan logs them as.
_METERED = {
    "all_to_all_single": "all_to_all",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "broadcast": "broadcast",
    "all_reduce": "all_reduce",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce": "reduce",
}


class _Meter:
    """Calls of ``torch.distributed`` counted where the library cannot see it: each metered function
    replaced by a wrapper that counts calls (per collective) and the bytes the tensors hold."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.real = {name: getattr(dist, name) for name in _METERED}
        for name, collective in _METERED.items():
            setattr(dist, name, self._counting(collective, self.real[name]))

    def _counting(self, collective: str, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[collective] = self.calls.get(collective, 0) + 1
            return real(*args, **kwargs)

        return counted

    def close(self) -> None:
        for name, real in self.real.items():
            setattr(dist, name, real)


def metered(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A second step counted by :class:`_Meter` (from the first step's end to the second's), next to
    the calls ``last_step_comm()`` reports for it, per collective."""
    model = make_model(dtype=DTYPES[cfg.get("dtype", "bf16")])
    opt = make_optimizer(
        model,
        hyper={"lr": 1e-2},
        stage=cfg["stage"],
        shard=cfg.get("shard"),
        collectives="min_bytes",  # one call per collective (the gloo policy's exchanges are many)
        wire_block=16,
        reduce_dtype=cfg.get("wire"),
        gather_dtype=cfg.get("gather"),
        **({"ranks_per_node": cfg["ranks_per_node"]} if "ranks_per_node" in cfg else {}),
    )
    opt.attach(model)
    opt.backward(loss_of(model, *batch(0, rank)))
    opt.step()
    meter = _Meter()
    try:
        opt.zero_grad()
        opt.backward(loss_of(model, *batch(1, rank)))
        opt.step()
    finally:
        meter.close()
    logged: dict[str, int] = {}
    for c in opt.last_step_comm():
        logged[c.collective.value] = logged.get(c.collective.value, 0) + c.calls
    return {"metered": meter.calls, "logged": logged}
