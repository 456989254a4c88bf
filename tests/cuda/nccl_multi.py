"""One configuration of ``ZeroOptimizer`` on 2-8 ranks, each on its own GPU over NCCL, against one process.

    torchrun --standalone --nproc_per_node=N tests/cuda/nccl_multi.py NAME               # NCCL
    torchrun --standalone --nproc_per_node=N tests/cuda/nccl_multi.py NAME --device cpu  # gloo, CPU
    python tests/cuda/nccl_multi.py --list     # the names, with the worlds each can run at (JSON)

Every rank runs the configuration on its own data (``SortTask`` batches of ``(step, rank)``);
rank 0 prints one JSON line of what ``tests/cuda/test_nccl_multi.py`` checks. ``--device cpu``
runs the same script on CPU tensors over gloo, to check it on a machine without GPUs; there it
passes ``collectives="min_bytes"`` (the policy NCCL gets by default: reduce-scatter, replica
all-reduce, all-gather) instead of gloo's own default (point-to-point exchanges), so that the
CPU run takes the code paths NCCL takes. On NCCL ``collectives`` is left at ``"auto"``.

[Note: multi-GPU reference]
As the CPU equivalence tests do (``tests/facade/test_equivalence.py``, ``world2_train.py``),
each of the first ``COMPARED`` steps checks three things on rank 0, against one unsharded
process that trains on the concatenation of every rank's batch (whose mean loss is the mean
of the per-rank losses the world averages: every sequence scores the same number of tokens):

* the gradient the step applies (``averaged_gradients()``, gathered from every rank, so that
  experts held elsewhere come along) against the reference's gradient of that mean loss,
  computed as the mean of the gradients of the batch's per-rank slices, each in the model's
  dtype, summed in fp32: within ``GRAD_TOL`` of the dtype (the world sums its gradients in the
  model's dtype, so they match to a few units of its precision). One bf16 backward over the
  whole batch would not do: it rounds differently from the slices' (on the demo GPT the
  LayerNorm gradients of the two differ by up to 7% of their largest element, and each from
  the fp32 gradient by up to 3%), which would hide the reduction's error;
* the world's mean loss against the reference's loss on the concatenated batch, within
  ``GRAD_TOL`` (relative);
* given those gradients, the sharded step against ``torch.optim.AdamW`` on fp32 masters of
  the whole model, rounded into the model: within ``FP32_TOL`` (bit-identical in practice).
  With clipping the reference clips by zeroplan's norm (as ``clip_grad_norm_`` does: the same
  coefficient), and that norm is compared with the reference's own within ``NORM_RTOL``.

Comparing the parameters of two free-running jobs would test the summation order (Adam's
normalised update magnifies a last-bit difference where gradients nearly cancel), not the
sharding. After them, ``PLAIN`` more steps run as a user's loop does (no inspection); on CUDA
``torch.cuda.set_sync_debug_mode("warn")`` counts the host synchronizations of all but the
first of them, over backward, clipping, ``step()``, ``zero_grad()`` and the next forward, by
the zeroplan line that made them (``SyncCounter`` of ``nccl_matrix.py``; [Note: one host read]).
Then, by configuration, a checkpoint round trip and ``consolidated_state_dict()``.

The ``overlap`` configuration is a probe rather than a comparison (see ``overlap``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from nccl_matrix import SyncCounter, tensors_of
from torch import nn
from world2_overlap import Stall, sleep_cycles

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade import checkpoint as ckpt
from zeroplan.facade.cli.demo.model import GPTConfig, SortTask, build_model, loss_of

COMPARED = 4  # steps compared with the reference
PLAIN = 4  # steps after them, as a user's loop; the first is not counted (first use of the plain path)
BATCH = 8  # sequences per rank and step
BUCKET_BYTES = 1 << 16  # several buckets (about 7 in bf16), so reductions can run during backward
CLIP = 0.1  # below the demo's gradient norm: clipping is active
HYPER = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "fused": True}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_TOL = 1e-6  # the sharded step given the same gradients (tests/facade/test_equivalence.py)
# Gradients against the exact one: a few units of the dtype's precision (test_equivalence.py's
# low-precision test, tests/cuda/test_gloo_world2.py's GRAD_TOL). The mean loss over the world
# against the reference's loss on the concatenation is held to the same.
GRAD_TOL = {"fp32": FP32_TOL, "bf16": 8 * 2**-7, "fp16": 8 * 2**-10}
NORM_RTOL = 1e-5  # the clip norm: summed shard by shard, the reference's over whole tensors
TASK = SortTask()
GPT = GPTConfig(vocab=TASK.vocab, context=TASK.context)

# Each: settings, "min_world" and "multiple" (the world must be a multiple of it).
CONFIGS: dict[str, dict[str, Any]] = {
    "stage1-bf16": {"stage": 1, "dtype": "bf16"},
    "stage2-bf16": {"stage": 2, "dtype": "bf16"},
    "stage3-bf16": {"stage": 3, "dtype": "bf16"},
    "stage2-fp16-dynamic-scale": {"stage": 2, "dtype": "fp16", "loss_scale": "dynamic"},
    "stage2-bf16-mics": {"stage": 2, "dtype": "bf16", "shard_group_size": 2, "min_world": 4, "multiple": 2},
    "stage2-bf16-two-hop": {"stage": 2, "dtype": "bf16", "ranks_per_node": 2, "min_world": 4, "multiple": 2},
    "stage2-bf16-experts": {"stage": 2, "dtype": "bf16", "model": "moe", "multiple": 2},
    "stage2-bf16-frozen-domain": {"stage": 2, "dtype": "bf16", "frozen_domain": True, "multiple": 2},
    "stage2-bf16-checkpoint": {"stage": 2, "dtype": "bf16", "checkpoint": True, "consolidate": True},
    "stage3-bf16-clip-checkpoint": {
        "stage": 3,
        "dtype": "bf16",
        "clip": True,
        "checkpoint": True,
        "consolidate": True,
    },
    "stage2-bf16-overlap": {"stage": 2, "dtype": "bf16", "probe": "overlap"},
    # deterministic=True: the world's final bits against rank 0 alone over the same canonical micro-batches
    "stage2-bf16-deterministic": {"stage": 2, "dtype": "bf16", "probe": "deterministic"},
    "stage3-bf16-deterministic-mics": {
        "stage": 3,
        "dtype": "bf16",
        "shard_group_size": 2,
        "probe": "deterministic",
        "min_world": 4,
        "multiple": 2,
    },
}
SETTINGS = ("stage", "shard_group_size", "ranks_per_node", "loss_scale")


def worlds(name: str) -> dict[str, int]:
    """The worlds ``name`` can run at: at least ``min_world``, a multiple of ``multiple``."""
    cfg = CONFIGS[name]
    return {"min_world": cfg.get("min_world", 2), "multiple": cfg.get("multiple", 1)}


# ---------------------------------------------------------------- a mixture of experts on any device
# tests/facade/moe.py's model (top-1 routing, expert-parallel groups of EP ranks exchanging tokens
# with all_to_all, each expert's gradient reduced over its expert-data-parallel group), with its
# exchange buffers on the tokens' device, so that it runs on NCCL.
WIDTH, HIDDEN, EXPERTS, EP = 32, 48, 4, 2


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class MoE(nn.Module):
    """Embedding, one top-1 MoE layer (residual), head; ``held``: the global experts it holds."""

    def __init__(self, held: range, ep_group: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(TASK.vocab, WIDTH)
        self.gate = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in held)
        self.head = nn.Linear(WIDTH, TASK.vocab)
        self.held = held
        self.ep_group = ep_group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).reshape(-1, WIDTH)
        weight, choice = self.gate(x).float().softmax(-1).max(-1)
        if self.ep_group is None:
            mixed = torch.zeros_like(x)
            for e, expert in zip(self.held, self.experts, strict=True):
                rows = choice == e
                mixed[rows] = expert(x[rows])
        else:
            n = x.shape[0]
            rows = torch.arange(n, device=x.device)
            slots = x.new_zeros(EXPERTS, n, WIDTH).index_put((choice, rows), x)
            parts = _AllToAll.apply(slots, self.ep_group).reshape(EP, len(self.held), n, WIDTH)
            done = torch.stack([expert(parts[:, i]) for i, expert in enumerate(self.experts)], dim=1)
            mixed = _AllToAll.apply(done.reshape(EXPERTS, n, WIDTH), self.ep_group)[choice, rows]
        out = x + weight.unsqueeze(-1).to(x.dtype) * mixed
        return self.head(out).reshape(*tokens.shape, TASK.vocab)


def held_experts(rank: int) -> range:
    k = EXPERTS // EP
    return range(k * (rank % EP), k * (rank % EP + 1))


def full_moe(dtype: torch.dtype, device: torch.device) -> MoE:
    """Every expert, the same values on every call."""
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = MoE(range(EXPERTS), None)
    finally:
        torch.random.set_rng_state(state)
    return model.to(device=device, dtype=dtype)


def expert_name(name: str, held: range) -> str:
    """A rank's parameter name as the full model names it (``experts.1.up.weight`` -> ``experts.3...``)."""
    if not name.startswith("experts."):
        return name
    _, index, rest = name.split(".", 2)
    return f"experts.{held[int(index)]}.{rest}"


def new_groups(world: int, size: int, strided: bool) -> Any:
    """Every rank creates every group (as ``new_group`` requires); this rank's group.

    ``strided``: the ranks ``r, r + size, ...`` apart (expert-data-parallel); else consecutive.
    """
    rank, mine = dist.get_rank(), None
    if strided:
        members = [list(range(start, world, size)) for start in range(size)]
    else:
        members = [list(range(start, start + size)) for start in range(0, world, size)]
    for ranks in members:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


# ---------------------------------------------------------------- the run
class Setup:
    """This rank's model, its param groups (and each parameter's name in the full model), the reference."""

    def __init__(self, cfg: dict[str, Any], rank: int, world: int, device: torch.device) -> None:
        dtype = DTYPES[cfg["dtype"]]
        self.device = device
        if cfg.get("model") == "moe":
            ep = new_groups(world, EP, strided=False)
            ep_dp = new_groups(world, EP, strided=True)
            held = held_experts(rank)
            full = full_moe(dtype, device)
            self.model = MoE(held, ep).to(device=device, dtype=dtype)
            theirs = dict(full.named_parameters())
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    p.copy_(theirs[expert_name(n, held)])
            named = list(self.model.named_parameters())
            dense = [(n, p) for n, p in named if not n.startswith("experts.")]
            experts = [(n, p) for n, p in named if n.startswith("experts.")]
            self.groups = [{"params": [p for _, p in dense]}, {"params": [p for _, p in experts]}]
            self.groups[1]["process_group"] = ep_dp
            self.names = [n for n, _ in dense] + [expert_name(n, held) for n, _ in experts]
            self.reference = full_moe(dtype, device) if rank == 0 else None
        else:
            self.model = build_model(GPT, seed=0, dtype=dtype, device=device)
            self.reference = build_model(GPT, seed=0, dtype=dtype, device=device) if rank == 0 else None
            named = list(self.model.named_parameters())
            if cfg.get("frozen_domain"):  # the head frozen, in a domain of its own: no trainable parameter
                pairs = new_groups(world, 2, strided=True)
                for model in (self.model, self.reference):
                    if model is not None:
                        model.head.weight.requires_grad_(False)
                rest = [(n, p) for n, p in named if not n.startswith("head.")]
                head = [(n, p) for n, p in named if n.startswith("head.")]
                self.groups = [{"params": [p for _, p in rest]}, {"params": [p for _, p in head]}]
                self.groups[1]["process_group"] = pairs
                self.names = [n for n, _ in rest + head]
            else:
                self.groups = [{"params": [p for _, p in named]}]
                self.names = [n for n, _ in named]
        self.own_names = [n for n, _ in self.model.named_parameters()]
        held = held_experts(rank) if cfg.get("model") == "moe" else range(0)
        self.full_names = [expert_name(n, held) for n in self.own_names]

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(self.device) for t in TASK.batch(step=step, rank=rank, size=BATCH))

    def slices(self, step: int, world: int) -> list[tuple[torch.Tensor, ...]]:
        """Every rank's batch of ``step``: the whole batch one process would train on, in slices."""
        return [self.batch(step, r) for r in range(world)]


class Reference:
    """One process: fp32 masters of every trainable parameter stepped by ``AdamW``, rounded into ``model``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.masters = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.optimizer = torch.optim.AdamW(list(self.masters.values()), **HYPER)

    def gradients(
        self, slices: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """The loss on the whole batch (the slices concatenated) and its gradient.

        The gradient of the mean over the whole batch is the mean of the slices' gradients: each
        computed in the model's dtype, summed in fp32 (see [Note: multi-GPU reference]).
        """
        with torch.no_grad():
            loss = float(loss_of(self.model, *(torch.cat(t) for t in zip(*slices, strict=True))))
        grads = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.params.items()}
        for tokens, targets in slices:
            self.model.zero_grad(set_to_none=True)
            loss_of(self.model, tokens, targets).backward()
            for n, p in self.params.items():
                if p.grad is not None:  # an expert no token of this slice was routed to: zero
                    grads[n] += p.grad.float()
        self.model.zero_grad(set_to_none=True)
        return loss, {n: g / len(slices) for n, g in grads.items()}

    def step(self, grads: dict[str, torch.Tensor], norm: torch.Tensor | None) -> None:
        """Step on ``grads``, clipped by ``norm`` when given (the coefficient as ``clip_grad_norm_``'s)."""
        for n, master in self.masters.items():
            master.grad = grads[n].to(master.device)
            if norm is not None:
                master.grad.mul_(torch.clamp(CLIP / (norm.to(master.device) + 1e-6), max=1.0))
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.masters[n])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm relative difference of two tensors (compared in fp32)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def gather(obj: Any, world: int) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (``None`` elsewhere)."""
    out = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def values(opt: ZeroOptimizer, model: nn.Module) -> list[torch.Tensor]:
    """Copies of the model's parameters (gathered at stage 3)."""
    with opt.gathered_params():
        return [p.detach().clone() for p in model.parameters()]


def run(name: str, rank: int, world: int, device: torch.device) -> dict[str, Any] | None:
    cfg = CONFIGS[name]
    if cfg.get("probe") == "overlap":
        return overlap(cfg, rank, world, device)
    if cfg.get("probe") == "deterministic":
        return deterministic(cfg, rank, world, device)
    s = Setup(cfg, rank, world, device)
    settings = {k: cfg[k] for k in SETTINGS if k in cfg}
    collectives = "min_bytes" if device.type == "cpu" else "auto"
    opt = ZeroOptimizer(
        s.groups, torch.optim.AdamW, bucket_bytes=BUCKET_BYTES, collectives=collectives, **settings, **HYPER
    )
    opt.attach(s.model)  # stage 3: gathers in forward; before the first forward
    ref = Reference(s.reference) if s.reference is not None else None
    losses: list[float] = []
    compared: list[dict[str, Any]] = []
    for step in range(COMPARED):
        loss = loss_of(s.model, *s.batch(step, rank))
        opt.backward(loss)
        reduced = opt.averaged_gradients()
        norm = opt.clip_grad_norm_(CLIP).detach().clone() if cfg.get("clip") else None
        opt.step()
        skipped = opt.last_step_skipped
        opt.zero_grad()
        losses.append(float(loss.detach()))
        mine = {n: g.detach().float().cpu() for n, g in zip(s.names, reduced, strict=True) if g is not None}
        everyone = gather((float(loss.detach()), mine), world)
        now = values(opt, s.model)
        if ref is None or everyone is None:
            continue
        grads: dict[str, torch.Tensor] = {}
        for _, theirs in everyone:  # each expert from a rank that holds it; the rest from any rank
            for n, g in theirs.items():
                grads.setdefault(n, g)
        ref_loss, exact = ref.gradients(s.slices(step, world))
        record: dict[str, Any] = {
            "loss": sum(mean for mean, _ in everyone) / world,
            "ref_loss": ref_loss,
            "skipped": skipped,
            "grad_err": max(rel_err(grads[n], exact[n]) for n in exact),
            "missing_grads": sorted(set(exact) - set(grads)),
        }
        if norm is not None:
            ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))
            record["norm"], record["ref_norm"] = float(norm), ref_norm
        if not skipped:  # a skipped step changes nothing, in the reference neither
            ref.step(grads, norm)
        theirs = dict(ref.model.named_parameters())
        pairs = [(a, theirs[n]) for n, a in zip(s.full_names, now, strict=True)]
        record["param_err"] = max(rel_err(a, b) for a, b in pairs)
        record["max_abs"] = max(float((a.float() - b.detach().float()).abs().max()) for a, b in pairs)
        compared.append(record)

    syncs: list[dict[str, int]] = []
    batches = [s.batch(COMPARED + k, rank) for k in range(PLAIN + 1)]
    current = loss_of(s.model, *batches[0])
    for k in range(PLAIN):
        counter = SyncCounter()
        window: Any = counter if k > 0 and device.type == "cuda" else contextlib.nullcontext()
        loss = current
        with window:
            opt.backward(loss)
            if cfg.get("clip"):
                opt.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
            current = loss_of(s.model, *batches[k + 1])
        if window is counter:
            syncs.append(dict(counter.where))
        losses.append(float(loss.detach()))
    comm = [[c.group, c.collective.value, c.link.value, c.calls, c.bytes] for c in opt.last_step_comm()]
    result: dict[str, Any] = {
        "compared": compared,
        "syncs": syncs,
        "zeroplan_syncs_per_step": [sum(n for w, n in w.items() if w != "other") for w in syncs],
        "comm": comm,
        "domains": [d.name for d in opt.domains],
        "loss_scale": opt.loss_scale,
    }
    if cfg.get("checkpoint"):
        result["checkpoint"] = checkpoint_round_trip(opt, s, rank, world)
    if cfg.get("consolidate"):
        result["consolidate"] = consolidate(opt, s.model, device)
    every = gather({"losses": losses, "result": result}, world)
    if every is None:
        return None
    result["losses"] = [sum(r["losses"][i] for r in every) / world for i in range(len(losses))]
    result["rank_syncs"] = [r["result"]["zeroplan_syncs_per_step"] for r in every]
    for key in ("checkpoint", "consolidate"):
        if key in result:
            result[f"rank_{key}"] = [r["result"][key] for r in every]
    return result


def state_tensors(opt: ZeroOptimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors_of(opt.state_dict())]


def checkpoint_round_trip(opt: ZeroOptimizer, s: Setup, rank: int, world: int) -> dict[str, bool]:
    """Save, train one step more, load: parameters and optimizer state are those saved, bit for bit."""
    box = [tempfile.mkdtemp(prefix="zeroplan-nccl-multi-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    try:
        saved, saved_state = values(opt, s.model), state_tensors(opt)
        ckpt.save(opt, root)
        opt.backward(loss_of(s.model, *s.batch(100, rank)))
        opt.step()
        opt.zero_grad()
        moved = any(not torch.equal(a, b) for a, b in zip(values(opt, s.model), saved, strict=True))
        ckpt.load(opt, root)
        back = all(torch.equal(a, b) for a, b in zip(values(opt, s.model), saved, strict=True))
        state_back = all(torch.equal(a, b) for a, b in zip(state_tensors(opt), saved_state, strict=True))
        # and training goes on from there
        opt.backward(loss_of(s.model, *s.batch(101, rank)))
        opt.step()
        opt.zero_grad()
        trains = all(bool(torch.isfinite(p).all()) for p in values(opt, s.model))
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return {"moved": moved, "params_back": back, "state_back": state_back, "trains_after": trains}


def consolidate(opt: ZeroOptimizer, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """``consolidated_state_dict()`` on rank 0: where its tensors live, its GPU peak; then loaded back."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    state = opt.consolidated_state_dict()
    out: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    if state is not None:
        out["devices"] = sorted({str(t.device) for t in tensors_of(state)})
        out["entries"] = len(state["state"])
    # A plain dict, sliced by every rank back into the same plan: the optimizer state is unchanged.
    before_state = state_tensors(opt)
    everywhere = opt.consolidated_state_dict(to_rank=None)
    assert everywhere is not None
    opt.load_state_dict(everywhere)
    after = state_tensors(opt)
    out["reloaded_equal"] = len(after) == len(before_state) and all(
        torch.equal(a, b) for a, b in zip(after, before_state, strict=True)
    )
    return out


# ---------------------------------------------------------------- overlap
STALL_S = 0.5  # a parameterless layer between the embeddings and the blocks sleeps this long in backward
WAIT_S = 10.0
OVERLAP_STEPS = 3  # the first warms up
REDUCTIONS = ("reduce_scatter_single", "reduce_scatter", "reduce", "all_reduce", "isend", "irecv")


class Probe:
    """Reductions launched during backward, and whether the first completed while backward still ran.

    The ``world2_overlap.py`` probe ([Note: overlap probe]) for NCCL: ``torch.distributed``'s
    reductions are wrapped, and a parameterless ``Stall`` layer between the embeddings and the
    blocks enqueues a ``torch.cuda._sleep`` of ``STALL_S`` in its backward, followed by an event:
    until that event completed the GPU has provably not finished backward. The first launch
    makes a stream of the probe's own wait for its work (on the device: NCCL's ``Work.wait()``
    blocks no host) and records an event there; inside the stall the host watches both events.
    The first reduction done while the stall's event is not is the overlap, seen without
    comparing clocks and without holding the work (which would keep its tensors, see [Note:
    retiring a collective]). On the CPU only the launches are observable: gloo's
    ``reduce_scatter`` work has no future and reports itself incomplete until waited for, so
    ``reduced_while_busy`` is ``None`` there.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.armed = False
        self.launches: list[str] = []
        self.first: Any = None
        self.stall_record: dict[str, Any] = {}
        self.cycles = sleep_cycles(STALL_S) if self.cuda else 0
        for fn in REDUCTIONS:
            setattr(dist, fn, self._wrap(fn, getattr(dist, fn)))

    def _wrap(self, fn: str, real: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            work = real(*args, **kwargs)
            if self.armed and work is not None:
                if not self.launches and self.cuda:
                    with torch.cuda.stream(self.stream):
                        work.wait()
                        self.first = self.stream.record_event()
                self.launches.append(fn)
            return work

        return traced

    def arm(self) -> None:
        self.launches, self.first, self.stall_record = [], None, {}
        self.armed = True

    def stall(self) -> None:
        """Backward of the stall: later gradients take long; was the first reduction done meanwhile?"""
        before = len(self.launches)
        if not self.cuda:  # the launches before the stall are what the CPU shows
            time.sleep(0.05)
            self.stall_record = {"launched_before_stall": before, "reduced_while_busy": None}
            return
        deadline = time.perf_counter() + WAIT_S
        torch.cuda._sleep(self.cycles)
        end = torch.cuda.current_stream().record_event()

        def done() -> bool:
            return self.first is not None and self.first.query()

        while not done() and not end.query() and time.perf_counter() < deadline:
            time.sleep(1e-4)
        first_done = done()
        busy = not end.query()  # read after `first_done`: both true, the reduction finished first
        self.stall_record = {"launched_before_stall": before, "reduced_while_busy": first_done and busy}

    def disarm(self) -> dict[str, Any]:
        self.armed = False
        if self.cuda:
            torch.cuda.synchronize()
        return {
            **self.stall_record,
            "launched_in_backward": len(self.launches),
            "kinds": sorted(set(self.launches)),
        }


def overlap(cfg: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any] | None:
    """``OVERLAP_STEPS`` probed steps with ``overlap_grad_reduce=True``, then with ``False`` (the control)."""
    probe = Probe(device)
    dtype = DTYPES[cfg["dtype"]]
    collectives = "min_bytes" if device.type == "cpu" else "auto"
    result: dict[str, Any] = {}
    for label, flag in (("overlap", True), ("no_overlap", False)):
        model = build_model(GPT, seed=0, dtype=dtype, device=device)
        model.blocks.insert(0, Stall(probe))  # backward: head, blocks, the stall, then the embeddings
        opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            stage=cfg["stage"],
            bucket_bytes=BUCKET_BYTES,
            collectives=collectives,
            overlap_grad_reduce=flag,
            **HYPER,
        )
        steps = []
        for step in range(OVERLAP_STEPS):
            loss = loss_of(model, *(t.to(device) for t in TASK.batch(step=step, rank=rank, size=BATCH)))
            probe.arm()
            opt.backward(loss)
            steps.append(probe.disarm())
            opt.step()
            opt.zero_grad()
        result[label] = {"buckets": len(opt.plan.buckets.buckets), "steps": steps}
        del opt, model
    every = gather(result, world)
    return None if every is None else {"ranks": every}


CANONICAL = 8  # deterministic probe: micro-batches per step (each rank runs CANONICAL / world)


def _canonical_run(
    cfg: dict[str, Any], rank: int, world: int, device: torch.device, group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """Three clipped steps of ``deterministic=True`` over this rank's canonical micro-batches; digests."""
    import hashlib

    model = build_model(GPT, seed=0, dtype=DTYPES[cfg["dtype"]], device=device)
    collectives = "min_bytes" if device.type == "cpu" else "auto"
    keys = ("stage", "shard_group_size") if group is None else ("stage",)  # alone: no shard groups
    settings = {k: cfg[k] for k in keys if k in cfg}
    opt = ZeroOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        process_group=group,
        bucket_bytes=BUCKET_BYTES,
        collectives=collectives,
        deterministic=True,
        **settings,
        **HYPER,
    )
    opt.attach(model)
    mine = CANONICAL // world
    norms = []
    for step in range(3):
        for k in range(rank * mine, (rank + 1) * mine):
            loss = loss_of(model, *(t.to(device) for t in TASK.batch(step=step, rank=k, size=2))) / mine
            with contextlib.nullcontext() if k == (rank + 1) * mine - 1 else opt.no_sync():
                opt.backward(loss)
        norms.append(repr(opt.clip_grad_norm_(CLIP).item()))
        opt.step()
        opt.zero_grad()
    digest = hashlib.sha256()
    for p in values(opt, model):
        digest.update(p.to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes())
    state = opt.consolidated_state_dict(None)
    assert state is not None
    for i in sorted(state["state"]):
        for _, v in sorted(state["state"][i].items()):
            if torch.is_tensor(v):
                digest.update(v.to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"digest": digest.hexdigest(), "norms": norms}


def deterministic(cfg: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any] | None:
    """``deterministic=True`` at this world, then rank 0 alone (a group of one) over all micro-batches.

    [Note: deterministic mode]: the two must end in the same bits (parameters, the whole optimizer
    state, every clip norm). Deterministic kernels are asked for (``use_deterministic_algorithms``).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at this process's first matmul
    torch.use_deterministic_algorithms(True)
    alone = dist.new_group([0])  # every rank creates every group
    ours = _canonical_run(cfg, rank, world, device, None)
    dist.barrier()
    if rank != 0:
        return None
    reference = _canonical_run(cfg, 0, 1, device, alone)
    return {"deterministic": {"world": ours, "alone": reference, "same": ours == reference}}


# ---------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="a configuration, or --list")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds after which a rank ends itself")
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--list":
        print(json.dumps({name: worlds(name) for name in CONFIGS}))
        return 0
    a = p.parse_args(argv)
    watchdog = threading.Timer(a.deadline, lambda: os._exit(124))  # torchrun gives each rank a session
    watchdog.daemon = True
    watchdog.start()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=a.timeout)
    if a.device == "cpu":
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    need = worlds(a.name)
    if world < need["min_world"] or world % need["multiple"]:
        print(f"{a.name} needs a world of at least {need['min_world']}, a multiple of {need['multiple']}")
        return 2
    try:
        result = run(a.name, rank, world, device)
    except Exception as error:
        trace = traceback.format_exc()
        print(f"rank {rank}: {trace}", file=sys.stderr, flush=True)
        if rank == 0:
            print(json.dumps({"name": a.name, "error": f"{type(error).__name__}: {error}", "trace": trace}))
        sys.stdout.flush()
        os._exit(1)  # the other ranks may wait in a collective: torchrun ends them
    if result is not None:
        result = {"name": a.name, "world": world, "device": str(device), **result}
        if device.type == "cuda":
            result["device_name"] = torch.cuda.get_device_name(device)
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
