"""One process, one GPU, NCCL: ``torch.compile`` (inductor, Triton) and torchao's low-bit AdamW.

    python tests/cuda/modern_world1.py PORT compile     # prints one JSON line
    python tests/cuda/modern_world1.py PORT lowbit
    python tests/cuda/modern_world1.py PORT compile-large   # the 163M GPT: step times only
    python tests/cuda/modern_world1.py PORT offload         # CPU offload against none
    python tests/cuda/modern_world1.py PORT background      # background saves beside the GPU

``compile``: the demo GPT in bf16, its blocks compiled then attached, at stages 2 and 3, against the
same compiled model stepped by ``AdamW(fused=True)`` on fp32 masters (what ``ZeroOptimizer`` does at
world 1); frames compiled after step 2, graph breaks, and step time eager against compiled (median
of 20 steps after warm-up, CUDA-synchronised). ``lowbit``: ``AdamW8bit`` inside ``ZeroOptimizer``
at stages 2 and 3 against torchao unsharded on fp32 masters (bits), and the state ``MemTracker``
counts against the plan.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import GPTConfig, build_model


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _batch(step: int, config: GPTConfig, device: torch.device, rows: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, config.vocab, (rows, config.context + 1), generator=g).to(device)


def _compile_blocks(model: torch.nn.Module) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)


class _Reference:
    """fp32 masters of ``model``'s parameters stepped by ``cls``; the model takes their rounding."""

    def __init__(self, model: torch.nn.Module, cls: type, **hyper: Any) -> None:
        self.model = model
        self.masters = [p.detach().float().clone() for p in model.parameters()]
        self.opt = cls(self.masters, **hyper)

    def step(self, tokens: torch.Tensor) -> float:
        loss = _loss(self.model, tokens)
        loss.backward()
        for master, p in zip(self.masters, self.model.parameters(), strict=True):
            master.grad, p.grad = p.grad.float(), None
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(self.masters, self.model.parameters(), strict=True):
                p.copy_(master)
        return float(loss)


def _differing(opt: ZeroOptimizer, model: torch.nn.Module, other: torch.nn.Module) -> int:
    """How many of ``model``'s parameters (gathered) differ in any bit from ``other``'s."""
    with opt.gathered_params():
        return sum(not torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))


def _timed(step: Any, tokens: torch.Tensor, n: int = 20) -> float:
    for _ in range(3):
        step(tokens)
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


#: ``compile``'s model, and ``compile-large``'s (the GPU benchmark's 163M GPT, a batch of 8 x 1024).
SIZES = {
    "compile": (GPTConfig(vocab=8192, width=512, layers=8, heads=8, context=256, qkv_bias=True), 16),
    "compile-large": (GPTConfig(vocab=50304, width=768, layers=12, heads=12, context=1024, qkv_bias=True), 8),
}


def compile_case(device: torch.device, size: str = "compile") -> dict[str, Any]:
    from torch._dynamo.utils import counters

    config, rows = SIZES[size]
    hyper = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}
    out: dict[str, Any] = {}
    for stage in (2, 3):
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            model = build_model(config, seed=0, dtype=torch.bfloat16, device=device)
            reference = _Reference(
                build_model(config, seed=0, dtype=torch.bfloat16, device=device), torch.optim.AdamW, **hyper
            )
            if compiled:
                _compile_blocks(model)
                _compile_blocks(reference.model)
            opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **hyper)
            opt.attach(model)

            def step(tokens: torch.Tensor, opt: ZeroOptimizer = opt, model: torch.nn.Module = model) -> float:
                loss = _loss(model, tokens)
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
                return float(loss)

            frames, losses, ref_losses = [], [], []
            for s in range(4):
                tokens = _batch(s, config, device, rows)
                losses.append(step(tokens))
                ref_losses.append(reference.step(tokens))
                frames.append(counters["frames"]["total"])
            differing = _differing(opt, model, reference.model)
            name = f"stage{stage}-{'block' if compiled else 'eager'}"
            out[name] = {
                "differing": differing,
                "losses_equal": losses == ref_losses,
                "frames": frames,
                "breaks": sum(counters["graph_break"].values()),
                "step_ms": _timed(step, _batch(9, config, device, rows)),
                "reference_step_ms": _timed(reference.step, _batch(9, config, device, rows)),
            }
    return out


def cudagraph_case(device: torch.device) -> dict[str, Any]:
    """Blocks compiled with ``mode="reduce-overhead"`` (CUDA graphs), attached, at stages 2 and 3."""
    from torch._dynamo.utils import counters

    config, rows = SIZES["compile"]
    hyper = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}
    out: dict[str, Any] = {}
    for stage in (2, 3):
        torch._dynamo.reset()
        counters.clear()
        model = build_model(config, seed=0, dtype=torch.bfloat16, device=device)
        reference = _Reference(
            build_model(config, seed=0, dtype=torch.bfloat16, device=device), torch.optim.AdamW, **hyper
        )
        for m in (model, reference.model):
            for i, block in enumerate(m.blocks):
                m.blocks[i] = torch.compile(block, mode="reduce-overhead")
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **hyper)
        opt.attach(model)
        error = None
        try:
            for s in range(5):
                tokens = _batch(s, config, device, rows)
                opt.backward(_loss(model, tokens))
                opt.step()
                opt.zero_grad()
                reference.step(tokens)
            differing = _differing(opt, model, reference.model)
        except Exception as exc:
            error, differing = f"{type(exc).__name__}: {str(exc)[:300]}", -1
        out[f"stage{stage}"] = {
            "error": error,
            "differing": differing,
            "inductor": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k},
            "frames": counters["frames"]["total"],
        }
    return out


def lowbit_case(device: torch.device) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torchao.optim import AdamW8bit

    config = GPTConfig(vocab=512, width=256, layers=2, heads=4, context=64, qkv_bias=True)
    out: dict[str, Any] = {}
    for stage in (2, 3):
        model = build_model(config, seed=0, dtype=torch.bfloat16, device=device)
        reference = _Reference(
            build_model(config, seed=0, dtype=torch.bfloat16, device=device), AdamW8bit, lr=1e-3
        )
        opt = ZeroOptimizer(model.parameters(), AdamW8bit, stage=stage, lr=1e-3)
        opt.attach(model)
        for s in range(3):
            tokens = _batch(s, config, device)
            opt.backward(_loss(model, tokens))
            opt.step()
            opt.zero_grad()
            reference.step(tokens)
        differing = _differing(opt, model, reference.model)
        tracker = MemTracker()
        tracker.track_external(opt.inner_optimizer)
        with tracker:
            pass
        measured = tracker.get_tracker_snapshot("current")[device]["Total"]
        out[f"stage{stage}"] = {
            "differing": differing,
            "measured_state": measured,
            "planned_state": opt.memory_report().ranks[0].optimizer_state_bytes,
            "quantized": sum(
                type(v).__module__.startswith("torchao.")
                for st in opt.inner_optimizer.state.values()
                for v in st.values()
            ),
        }
    return out


def _host_syncs(step: Any, tokens: torch.Tensor) -> int:
    """Synchronising operations CUDA's sync detector reports in one step (after warm-up)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def offload_case(device: torch.device) -> dict[str, Any]:
    """CPU offload ([Note: offload, executed]) against the same optimizer without it, bf16, stages 2
    and 3 (``all``), and stage 2 with half of the state kept on the device (``offload_fraction``,
    [Note: kept on the device]): parameters close (CPU and CUDA fused AdamW round alike or nearly),
    the device peak lower by what the plan moves to the host, the sync detector's count, step times."""
    config, rows = SIZES["compile"]
    hyper = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}
    out: dict[str, Any] = {}
    for stage, mode, fraction in ((2, "optimizer", None), (3, "all", None), (2, "optimizer", 0.5)):
        runs: dict[str, Any] = {}
        for offload in (None, mode):
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            model = build_model(config, seed=0, dtype=torch.bfloat16, device=device)
            opt = ZeroOptimizer(
                model.parameters(),
                torch.optim.AdamW,
                stage=stage,
                offload=offload,
                offload_fraction=fraction if offload else None,
                **hyper,
            )
            opt.attach(model)

            def step(tokens: torch.Tensor, opt: ZeroOptimizer = opt, model: torch.nn.Module = model) -> float:
                loss = _loss(model, tokens)
                opt.backward(loss)
                opt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
                return float(loss)

            losses = [step(_batch(s, config, device, rows)) for s in range(4)]
            torch.cuda.synchronize()
            with opt.gathered_params():
                params = [p.detach().float().clone() for p in model.parameters()]
            report = opt.memory_report().ranks[0]
            runs[str(offload)] = {
                "losses": losses,
                "params": params,
                "peak": torch.cuda.max_memory_allocated(device) - before,
                "planned_device_peak": report.device_peak_bytes,
                "planned_host": report.host_bytes,
                "syncs": _host_syncs(step, _batch(7, config, device, rows)),
                "step_ms": _timed(step, _batch(9, config, device, rows), n=10),
            }
            del opt, model
        plain, moved = runs["None"], runs[mode]
        error = max(
            float(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item())
            for a, b in zip(moved.pop("params"), plain.pop("params"), strict=True)
        )
        name = f"stage{stage}-{mode}" + ("" if fraction is None else f"-{fraction}")
        out[name] = {"max_rel_error": error, "plain": plain, "offload": moved}
    return out


def background_save_case(device: torch.device, root: str | None = None) -> dict[str, Any]:
    """Background saves ([Note: background saves]) beside the GPU: the staging pinned and filled on the
    side stream while training goes on; training bit-identical with and without them, the snapshot the
    state of its call, the staged bytes the planned ones, and the time a save stops training."""
    import tempfile
    from pathlib import Path

    from zeroplan.facade import checkpoint
    from zeroplan.facade.checkpoint import background

    config, rows = SIZES["compile"]
    hyper = {"lr": 1e-3, "weight_decay": 0.1}
    out: dict[str, Any] = {}
    for stage in (2, 3):
        where = Path(root or tempfile.mkdtemp(prefix="zeroplan-bg-")) / f"stage{stage}"
        runs: dict[str, Any] = {}
        for saving in (False, True):
            model = build_model(config, seed=0, dtype=torch.bfloat16, device=device)
            opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **hyper)
            opt.attach(model)
            returned, at_save = [], None
            for s in range(4):
                opt.backward(_loss(model, _batch(s, config, device, rows)))
                opt.step()
                opt.zero_grad()
                if saving:
                    if s == 3:
                        with opt.gathered_params():
                            at_save = [p.detach().clone() for p in model.parameters()]
                    started = time.perf_counter()
                    checkpoint.save(opt, where, blocking=False)
                    returned.append(time.perf_counter() - started)
            staging = background.staging_bytes(opt)
            pinned = all(t.is_pinned() for t in _staging_tensors(opt)) if device.type == "cuda" else None
            started = time.perf_counter()
            checkpoint.save(opt, Path(f"{where}-blocking"))  # waits for the last background save first
            blocking = time.perf_counter() - started
            with opt.gathered_params():
                params = [p.detach().clone() for p in model.parameters()]
            runs[str(saving)] = {
                "params": params,
                "returned_s": statistics.median(returned) if returned else None,
                "blocking_s": blocking,
                "staged": staging,
                "planned": opt.memory_report().ranks[0].save_staging_bytes,
                "pinned": pinned,
                "at_save": at_save,
            }
            del opt, model
        plain, saved = runs["False"], runs["True"]
        fresh = build_model(config, seed=1, dtype=torch.bfloat16, device=device)
        loader = ZeroOptimizer(fresh.parameters(), torch.optim.AdamW, stage=stage, **hyper)
        loader.attach(fresh)
        checkpoint.load(loader, where)  # the last background save
        with loader.gathered_params():
            loaded = [p.detach().clone() for p in fresh.parameters()]
        pairs = list(zip(plain.pop("params"), saved.pop("params"), strict=True))
        out[f"stage{stage}"] = {
            "same_training": all(torch.equal(a, b) for a, b in pairs),
            # Two runs of this model differ by themselves where kernels use atomics (the embedding's
            # backward on CUDA): what saving may add is measured against that.
            "max_rel_error": max(
                float(((b.float() - a.float()).abs().max() / a.float().abs().max().clamp(min=1e-12)).item())
                for a, b in pairs
            ),
            "snapshot_is_save_time": all(
                torch.equal(a, b) for a, b in zip(loaded, saved.pop("at_save"), strict=True)
            ),
            "returned_s": saved["returned_s"],
            "blocking_s": saved["blocking_s"],
            "staged": saved["staged"],
            "planned": saved["planned"],
            "pinned": saved["pinned"],
        }
    return out


def _staging_tensors(opt: ZeroOptimizer) -> list[torch.Tensor]:
    from zeroplan.facade.checkpoint import background

    return background.staging_buffers(opt)


def main(port: int, case: str) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}", device_id=device
    )
    try:
        if case == "cudagraphs":
            return cudagraph_case(device)
        if case == "offload":
            return offload_case(device)
        if case == "background":
            return background_save_case(device)
        return compile_case(device, case) if case in SIZES else lowbit_case(device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])))
