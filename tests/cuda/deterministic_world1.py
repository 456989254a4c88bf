"""Deterministic mode on one device: the same bits at every stage, layout, bucket size and overlap.

    python tests/cuda/deterministic_world1.py PORT [cpu|cuda]    # prints one JSON line

World 1 (NCCL on CUDA, gloo on CPU), the demo GPT in bf16, G=4 canonical micro-batches, three steps
with clipping, ``torch.use_deterministic_algorithms(True)`` (and cuBLAS's deterministic workspace),
one thread on CPU. Each configuration trains from the same model and batches; the sha256 of its
final parameters and whole optimizer state, and its norms, must be the same for all of them and
for a second run of the first ([Note: deterministic mode]: at world 1 only the world size is not
varied; the multi-process tests in ``tests/facade`` vary it on CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import torch
import torch.distributed as dist

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import GPTConfig, SortTask, build_model, loss_of

CONFIGS: dict[str, dict[str, Any]] = {
    "stage2": {"stage": 2},
    "stage2-again": {"stage": 2},
    "stage1": {"stage": 1},
    "stage1-interleaved": {"stage": 1, "layout": "interleaved"},
    "stage2-small-buckets": {"stage": 2, "bucket_bytes": 4096},
    "stage2-no-overlap": {"stage": 2, "overlap_grad_reduce": False, "overlap_param_gather": False},
    "stage3": {"stage": 3},
    "stage3-keep-gathered": {"stage": 3, "reshard_after_forward": False},
}
G, STEPS = 4, 3


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    config = GPTConfig(vocab=32, width=64, layers=2, heads=4, context=24, ffn=256)
    model = build_model(config, seed=0, dtype=torch.bfloat16).to(device)
    opt = ZeroOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=3e-3,
        weight_decay=0.1,
        deterministic=True,
        **{"bucket_bytes": 64 * 1024, **cfg},
    )
    opt.attach(model)
    task = SortTask()
    norms = []
    for step in range(STEPS):
        for k in range(G):
            tokens, targets = task.batch(step=step, rank=k, size=4)
            loss = loss_of(model, tokens.to(device), targets.to(device)) / G
            if k < G - 1:
                with opt.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
        norms.append(repr(opt.clip_grad_norm_(1.0).item()))
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = _digest(list(model.parameters()))
    state = opt.consolidated_state_dict(None)
    assert state is not None
    entries = [state["state"][i] for i in sorted(state["state"])]
    tensors = [v for entry in entries for _, v in sorted(entry.items()) if torch.is_tensor(v)]
    return {"params": params, "state": _digest(tensors), "norms": norms}


def main(port: int, on: str) -> dict[str, Any]:
    device = torch.device("cuda", 0) if on == "cuda" else torch.device("cpu")
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        results = {name: train(cfg, device) for name, cfg in CONFIGS.items()}
    finally:
        dist.destroy_process_group()
    first = results["stage2"]
    differing = [name for name, r in results.items() if r != first]
    return {"device": str(device), "results": results, "differing": differing}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cuda")))
