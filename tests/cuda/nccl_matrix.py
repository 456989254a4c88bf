"""One configuration of ``ZeroOptimizer`` on one GPU over NCCL, against ``AdamW(fused=True)``.

    python tests/cuda/nccl_matrix.py PORT NAME      # prints one JSON line
    python tests/cuda/nccl_matrix.py --list         # the configuration names
    python tests/cuda/nccl_matrix.py PORT NAME cpu  # the same on the CPU over gloo (a check of the script)

Each configuration trains the demo GPT for a few steps at world 1 and reports
what ``tests/cuda/test_nccl_matrix.py`` checks:

* the parameters against the reference of ``nccl_world1.py`` (fp32 masters stepped by
  ``AdamW(fused=True)``, rounded into the model): at world 1 every reduction is a copy, so
  they are expected bit-identical (with clipping, the norm is summed shard by shard and
  may differ in its last bits: then within a tolerance);
* the device-host synchronizations zeroplan makes per step, counted by CUDA's own
  detector (``torch.cuda.set_sync_debug_mode("warn")``) over backward, clipping, step,
  ``zero_grad`` and the next forward, by the line that made them ([Note: one host read]);
* NCCL takes no CPU tensor: a domain with no trainable parameter, a checkpoint saved and
  loaded, the consolidated state dict, all run here on a group without gloo.

A fresh process per configuration, so that one that crashes or hangs does not take
the others with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist

import zeroplan
from zeroplan.facade import ZeroOptimizer
from zeroplan.facade import checkpoint as ckpt
from zeroplan.facade.cli.demo.model import GPTConfig, SortTask, build_model, loss_of

STEPS = 5
COUNTED = range(2, STEPS)  # steps whose synchronizations are counted (0-1 warm up)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS: dict[str, dict[str, Any]] = {
    "stage1-fp32": {"stage": 1, "dtype": "fp32"},
    "stage1-bf16-rank-major": {"stage": 1, "dtype": "bf16", "layout": "rank_major"},
    "stage2-bf16": {"stage": 2, "dtype": "bf16"},
    "stage2-bf16-no-overlap": {
        "stage": 2,
        "dtype": "bf16",
        "overlap_grad_reduce": False,
        "overlap_param_gather": False,
    },
    "stage2-bf16-clip": {"stage": 2, "dtype": "bf16", "clip": True},
    "stage2-fp16-dynamic-scale": {"stage": 2, "dtype": "fp16", "loss_scale": "dynamic"},
    "stage2-bf16-frozen-domain": {"stage": 2, "dtype": "bf16", "frozen_domain": True},
    "stage2-bf16-checkpoint": {"stage": 2, "dtype": "bf16", "checkpoint": True, "consolidate": True},
    "stage3-bf16": {"stage": 3, "dtype": "bf16"},
    "stage3-fp32-keep-gathered": {"stage": 3, "dtype": "fp32", "reshard_after_forward": False},
    "stage3-bf16-clip-checkpoint": {"stage": 3, "dtype": "bf16", "clip": True, "checkpoint": True},
}
SETTINGS = ("stage", "layout", "overlap_grad_reduce", "overlap_param_gather", "loss_scale")
HYPER = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "fused": True}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(zeroplan.facade.__file__)))


class SyncCounter:
    """CUDA's synchronizing calls, by the line of zeroplan (or ``other``) that made them."""

    def __init__(self) -> None:
        self.where: Counter[str] = Counter()
        self._catch = warnings.catch_warnings(record=True)
        self._records: list[warnings.WarningMessage] = []

    def __enter__(self) -> SyncCounter:
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        for record in self._records:
            if "synchroniz" not in str(record.message):
                continue
            path = os.path.abspath(record.filename)
            ours = any(path.startswith(os.path.join(_PACKAGE, part) + os.sep) for part in ("core", "facade"))
            self.where[f"{os.path.relpath(path, _PACKAGE)}:{record.lineno}" if ours else "other"] += 1

    def zeroplan_total(self) -> int:
        return sum(n for site, n in self.where.items() if site != "other")


def _params(model: torch.nn.Module, cfg: dict[str, Any]) -> Any:
    """The model's parameters; with ``frozen_domain`` the head is a domain of its own, frozen."""
    if not cfg.get("frozen_domain"):
        return model.parameters()
    head = [p for n, p in model.named_parameters() if n.startswith("head.")]
    for p in head:
        p.requires_grad_(False)
    rest = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    return [{"params": rest}, {"params": head, "process_group": dist.new_group([0])}]


def run(name: str, device: torch.device) -> dict[str, Any]:
    cfg = CONFIGS[name]
    dtype = DTYPES[cfg["dtype"]]
    task = SortTask()
    config = GPTConfig(vocab=task.vocab, context=task.context)
    model = build_model(config, seed=0, dtype=dtype, device=device)
    reference = build_model(config, seed=0, dtype=dtype, device=device)
    settings = {k: cfg[k] for k in SETTINGS if k in cfg}
    if "reshard_after_forward" in cfg:
        settings["reshard_after_forward"] = cfg["reshard_after_forward"]
    opt = ZeroOptimizer(_params(model, cfg), torch.optim.AdamW, **settings, **HYPER)
    opt.attach(model)
    _params(reference, cfg)
    trained = [p for p in reference.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in trained]
    ref_opt = torch.optim.AdamW(masters, **HYPER)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in task.batch(step=step, rank=0, size=8))

    losses: list[float] = []
    ref_losses: list[float] = []
    norms: list[tuple[float, float]] = []
    syncs: list[dict[str, int]] = []
    current = loss_of(model, *batch(0))
    for step in range(STEPS):
        counter = SyncCounter()
        window: Any = counter if step in COUNTED else contextlib.nullcontext()
        loss = current
        with window:
            opt.backward(loss)
            norm = opt.clip_grad_norm_(1.0) if cfg.get("clip") else None
            opt.step()
            opt.zero_grad()
            current = loss_of(model, *batch(step + 1))
        if step in COUNTED:
            syncs.append(dict(counter.where))
        losses.append(float(loss))
        ref_loss = loss_of(reference, *batch(step))
        ref_losses.append(float(ref_loss))
        if cfg.get("loss_scale"):
            continue  # a dynamic scale may skip steps: the reference does not follow it
        ref_loss.backward()
        for master, p in zip(masters, trained, strict=True):
            master.grad, p.grad = p.grad.float(), None
        if norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(masters, 1.0)
            norms.append((float(norm), float(ref_norm)))
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, trained, strict=True):
                p.copy_(master)
    names = [n for n, _ in model.named_parameters()]
    pairs = list(zip(zip(names, _values(opt, model), strict=True), reference.parameters(), strict=True))
    result: dict[str, Any] = {
        "name": name,
        "losses": losses,
        "ref_losses": ref_losses,
        "differing": [n for (n, a), b in pairs if not torch.equal(a, b)],
        "max_abs": max(float((a.float() - b.float()).abs().max()) for (_, a), b in pairs),
        "norms": norms,
        "syncs": syncs,
        "zeroplan_syncs_per_step": [sum(n for s, n in w.items() if s != "other") for w in syncs],
        "skipped_last": opt.last_step_skipped,
    }
    if cfg.get("checkpoint"):
        result["checkpoint_equal"] = _checkpoint_round_trip(opt, model, batch)
    if cfg.get("consolidate"):
        result["consolidate"] = _consolidate(opt, model, device)
    return result


def _checkpoint_round_trip(opt: ZeroOptimizer, model: torch.nn.Module, batch: Callable[[int], Any]) -> bool:
    """Save, train one step more, load: the parameters are those saved, bit for bit."""
    saved = _values(opt, model)
    with tempfile.TemporaryDirectory() as root:
        ckpt.save(opt, root)
        opt.backward(loss_of(model, *batch(STEPS + 1)))
        opt.step()
        opt.zero_grad()
        moved = any(not torch.equal(a, b) for a, b in zip(_values(opt, model), saved, strict=True))
        ckpt.load(opt, root)
        back = all(torch.equal(a, b) for a, b in zip(_values(opt, model), saved, strict=True))
    return moved and back


def _values(opt: ZeroOptimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of the model's parameters (gathered at stage 3)."""
    with opt.gathered_params():
        return [p.detach().clone() for p in model.parameters()]


def _consolidate(opt: ZeroOptimizer, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """``consolidated_state_dict()``: where its tensors live and what it adds to the GPU's peak."""
    if device.type != "cuda":
        state = opt.consolidated_state_dict()
        return {"devices": sorted({str(t.device) for t in tensors_of(state)})}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state = opt.consolidated_state_dict()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    devices = sorted({str(t.device) for t in tensors_of(state)})
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"devices": devices, "gpu_peak_bytes": peak, "param_bytes": param_bytes}


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a (state-dict) tree."""
    return [leaf for leaf in optree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def main(port: int, name: str, on: str) -> dict[str, Any]:
    init = f"tcp://127.0.0.1:{port}"
    if on == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=init)
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, init_method=init, device_id=device)
    try:
        return run(name, device)
    except Exception as error:  # reported, with where it came from
        return {"name": name, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--list":
        print("\n".join(CONFIGS))
    else:
        print(json.dumps(main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "cuda")))
