"""Wire formats: what ZeroOptimizer's gradient and parameter wires cost in accuracy, time and bytes.

[Note: wire formats] in ``zeroplan.core.wire`` describes the codecs: gradients
travel as ``reduce_dtype`` (``None``: the parameter dtype, summed in it;
``"fp32"``, ``"bf16"``, blockwise ``"int8"`` / ``"fp8"``: exchanged with
``all_to_all`` and added in fp32 by the receiver), parameters as
``gather_dtype`` (``None``: their own dtype; ``"bf16"``, ``"int8"``, ``"fp8"``).
Both modes run gloo processes on CPU (one torch thread each), spawned fresh per
configuration, with zeroplan's demo GPT (``_gpt.GPT``). If this build's
``ZeroOptimizer`` takes no ``gather_dtype`` argument, the parameter-wire
configurations are skipped with a printed line.

``--converge`` trains a 0.8M-parameter demo GPT (``CONVERGE_MODEL``: width 128,
4 layers) on the sort task of ``zeroplan demo`` ([Note: demo task]: the batch of
a rank at a step is a pure function of ``(seed, step, rank)``, so every
configuration sees the same data; 16 sequences per rank) at world 4 for
``--steps`` steps (default 300) with ``ZeroOptimizer(AdamW, stage=--stage)``, the same initial
weights (seed 0, rounded to bf16 for the bf16 rows), no clipping, no loss
scaling, loss computed in fp32. Configurations (``CONVERGE``): the fp32
reference (fp32 parameters, default wire), then bf16 parameters (fp32 masters)
with the default wire (gradients summed in bf16, today's behaviour), each
``reduce_dtype``, ``gather_dtype`` int8 / fp8, and both int8. Reported per
configuration: the loss (mean over ranks of each rank's batch loss; mean of the
last 20 steps, and the last step), its distance from the fp32 reference's, the
largest absolute difference of the final parameters (rank 0, inside
``gathered_params()``, as fp32) from the fp32 reference's and from the
``bf16 reduce=fp32`` run's (bf16 gradients added in fp32, no wire rounding:
what is left there is the other wires' own error and its amplification),
and the bytes rank 0 sent in the last step
(``last_step_comm()``). Training amplifies rounding (see [Note: tolerance] in
``zeroplan.facade.cli.demo.outcome``: bf16 runs decorrelate within ~100 steps),
so after a few hundred steps every bf16 row differs from the fp32 reference by
about as much as the default wire does: compare the rows with the ``bf16``
row (the control) rather than with zero. So the table also gives what comes
before that: the mean distance of the loss from the reference's over the first
``EARLY_LOSS`` steps and the parameters' after ``EARLY`` steps; and with
``--seeds N`` every row is the mean over N seeds (model initialisation and
data), each compared with the reference run of its seed, with the spread of
the final loss over seeds: the margin a codec's final loss is judged by.

``--speed`` times worlds 2 and 4 (``--worlds``) in interleaved fresh-process
rounds as ``step_time.py --fresh-rounds`` does (its ``run_fresh`` and
``timed_steps`` are reused): each of ``--rounds`` rounds (default 3) runs every
configuration once, in newly spawned processes, in an order rotated every
round; a configuration warms up, then runs its timed steps back to back on a
fixed synthetic batch per rank (``_gpt.make_batch``, the 7M-parameter
``GPT_7M``); a step's time is the slowest rank's; a round's time is the median
over its steps; the table reports the median over rounds, and the ratio to
``ddp`` of the same round (median over rounds, min-max). Configurations
(``SPEED``):

* ``ddp``            DDP + ``AdamW(foreach=True)``, fp32 parameters (the ratio base)
* ``ddp+bf16hook``   the same with ``default_hooks.bf16_compress_hook``: fp32
  gradients cast to bf16 (divided by the world) for the all-reduce, summed in
  bf16, cast back. DDP refuses to register it by name without CUDA and NCCL,
  so it is registered through a wrapper of another name (:func:`bf16_hook_on_gloo`)
* ``ddp-bf16``       DDP with bf16 parameters (it runs on gloo): a compute-matched
  baseline for the ZeroOptimizer rows, though AdamW then steps bf16 weights
  directly (no fp32 masters: another algorithm, worse convergence)
* ``zero``           ``ZeroOptimizer(AdamW, stage=--stage)`` on bf16 parameters, default wire
* ``zero r=<fmt>``   the same with ``reduce_dtype`` fp32, bf16, int8, fp8
* ``zero g=<fmt>``   the same with ``gather_dtype`` int8, fp8

The ratio base is fp32 DDP: the bf16 hook is meant for compressing fp32
gradients, and DDP keeps no fp32 masters, so fp32 DDP is the algorithm the bf16
ZeroOptimizer rows (fp32 masters, bf16 compute) stand in for. DDP on bf16
parameters does run on CPU with gloo, so ``ddp-bf16`` is measured too and the
table also gives each row's ratio to it (same compute dtype, same gradient
bytes as the default wire). Sent bytes per step per rank: ZeroOptimizer measured
(``last_step_comm()``); DDP computed as a ring all-reduce, 2(W-1)/W of the
gradient bytes (halved by the bf16 hook). Loss: after the timed steps, on each
rank's batch, mean over ranks.

Usage::

    python benchmarks/wire.py --converge --quick          # smoke run: tiny model, a few steps
    python benchmarks/wire.py --speed --quick             # worlds 2 and 4, one round
    python benchmarks/wire.py --converge --json converge.json     # about 4 min on 2 cores
    python benchmarks/wire.py --converge --seeds 3                # three seeds: about 12 min
    python benchmarks/wire.py --speed --rounds 2 --json speed.json   # about 6 min on 2 cores
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt import GPT, GPT_7M, GPT_TINY, GPTConfig, lm_loss, make_batch
from step_time import MB, Options, Runner, Variant, _join, _spread, leave, run_fresh, timed_steps

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import SortTask

__all__ = ["CONVERGE", "SPEED", "WireConfig", "WireOptions", "WireRunner", "bf16_hook_on_gloo", "main"]

LR = 1e-3
WEIGHT_DECAY = 0.01
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TAIL = 20  # --converge: the final loss is the mean of the last TAIL steps
EARLY = 20  # --converge: parameters are compared after EARLY steps too, before training decorrelates them
EARLY_LOSS = 100  # --converge: the mean |loss - reference loss| over the first EARLY_LOSS steps
REFERENCE = "fp32"  # --converge: the reference configuration
EXACT = "bf16 reduce=fp32"  # --converge: bf16 parameters, gradients added in fp32 (no wire rounding)

#: ``--converge``: 802,944 parameters, the demo's task; at world 4 about 100 ms a step on 2 busy cores.
CONVERGE_MODEL = GPTConfig(vocab=32, width=128, layers=4, heads=4, context=24)
CONVERGE_TASK = SortTask(length=12, vocab=32, seed=0)
#: ``--converge --quick``.
QUICK_MODEL = GPTConfig(vocab=16, width=32, layers=1, heads=2, context=8)
QUICK_TASK = SortTask(length=4, vocab=16, seed=0)


@dataclass(frozen=True)
class WireConfig(Variant):
    """A configuration: ``kind`` ``"ddp"`` or ``"zero"`` (stage: ``--stage``), its dtype and wires."""

    dtype: str = "bf16"
    reduce_dtype: str | None = None
    gather_dtype: str | None = None
    bf16_hook: bool = False  # DDP: default_hooks.bf16_compress_hook

    def wire_kwargs(self, block: int) -> dict[str, Any]:
        """ZeroOptimizer's wire arguments (only those set: an older build takes no ``gather_dtype``)."""
        kwargs: dict[str, Any] = {"wire_block": block}
        if self.reduce_dtype is not None:
            kwargs["reduce_dtype"] = self.reduce_dtype
        if self.gather_dtype is not None:
            kwargs["gather_dtype"] = self.gather_dtype
        return kwargs


CONVERGE = (
    WireConfig(REFERENCE, "zero", dtype="fp32", note="fp32 parameters, default wire (the reference)"),
    WireConfig("bf16", "zero", note="bf16 parameters, default wire: gradients summed in bf16"),
    WireConfig(EXACT, "zero", reduce_dtype="fp32", note="gradients sent as fp32, added in fp32"),
    WireConfig("bf16 reduce=bf16", "zero", reduce_dtype="bf16", note="gradients sent as bf16, added in fp32"),
    WireConfig("bf16 reduce=int8", "zero", reduce_dtype="int8", note="gradients int8, blockwise scales"),
    WireConfig("bf16 reduce=fp8", "zero", reduce_dtype="fp8", note="gradients fp8 e4m3, blockwise scales"),
    WireConfig("bf16 gather=int8", "zero", gather_dtype="int8", note="parameters gathered as int8"),
    WireConfig("bf16 gather=fp8", "zero", gather_dtype="fp8", note="parameters gathered as fp8 e4m3"),
    WireConfig(
        "bf16 both=int8", "zero", reduce_dtype="int8", gather_dtype="int8", note="int8 gradients and params"
    ),
)

SPEED = (
    WireConfig("ddp", "ddp", dtype="fp32", note="DDP + AdamW(foreach), fp32 parameters"),
    WireConfig("ddp+bf16hook", "ddp", dtype="fp32", bf16_hook=True, note="the same + bf16_compress_hook"),
    WireConfig("ddp-bf16", "ddp", note="DDP + AdamW(foreach), bf16 parameters (no fp32 masters)"),
    WireConfig("zero", "zero", note="ZeroOptimizer, bf16 parameters, default wire"),
    WireConfig("zero r=fp32", "zero", reduce_dtype="fp32", note="reduce_dtype='fp32'"),
    WireConfig("zero r=bf16", "zero", reduce_dtype="bf16", note="reduce_dtype='bf16'"),
    WireConfig("zero r=int8", "zero", reduce_dtype="int8", note="reduce_dtype='int8'"),
    WireConfig("zero r=fp8", "zero", reduce_dtype="fp8", note="reduce_dtype='fp8'"),
    WireConfig("zero g=int8", "zero", gather_dtype="int8", note="gather_dtype='int8'"),
    WireConfig("zero g=fp8", "zero", gather_dtype="fp8", note="gather_dtype='fp8'"),
)


@dataclass
class WireOptions(Options):
    """``step_time.Options`` (``fresh_rounds``: ``--rounds``) plus this benchmark's settings."""

    stage: int = 2
    wire_block: int = 128
    task: SortTask = CONVERGE_TASK
    converge_world: int = 4
    seeds: int = 1


def gather_wire_supported() -> bool:
    """Whether this build's ``ZeroOptimizer`` takes ``gather_dtype`` (the parameter wire)."""
    return "gather_dtype" in inspect.signature(ZeroOptimizer.__init__).parameters


def bf16_hook_on_gloo(process_group, bucket):  # unannotated: see below
    """``default_hooks.bf16_compress_hook`` under another name (see the module docstring).

    ``DistributedDataParallel.register_comm_hook`` refuses a hook of that name unless CUDA and
    NCCL >= 2.10 are present ("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+
    or XPU and XCCL", torch 2.13): a check of the name only; the hook casts to bf16, all-reduces
    and casts back, which gloo does on CPU. No annotations: DDP compares them with
    ``dist.GradBucket`` and ``Future[Tensor]``, and this module's are strings (``__future__``).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


class WireRunner(Runner):
    """One configuration's model (in its dtype), DDP or ZeroOptimizer, and step on this rank."""

    def __init__(self, config: WireConfig, opts: WireOptions, world: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.variant = config
        self.world = world
        torch.manual_seed(opts.seed)
        self.model = GPT(opts.model).to(DTYPES[config.dtype])
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        hyper: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": True}
        self.zero: Any = None
        if config.kind == "zero":
            self.zero = ZeroOptimizer(
                self.model.named_parameters(),
                torch.optim.AdamW,
                stage=opts.stage,
                bucket_bytes=int(opts.bucket_mb * MB),
                **config.wire_kwargs(opts.wire_block),
                **hyper,
            )
            self.zero.attach(self.model)  # stage 3 gathers in forward; nothing at stages 1-2
            self.module: torch.nn.Module = self.model
            self.optimizer: torch.optim.Optimizer = self.zero
            return
        self.module = DistributedDataParallel(self.model, bucket_cap_mb=opts.bucket_mb)
        if config.bf16_hook:
            self.module.register_comm_hook(None, bf16_hook_on_gloo)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **hyper)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, *, wait: bool = False) -> torch.Tensor:
        """One training step, loss in fp32 (positions with target -100 ignored); returns the loss."""
        loss = lm_loss(self.module(tokens).float(), targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if wait:
            self.wait()
        return loss.detach()

    def comm_bytes(self) -> tuple[int, bool]:
        """Bytes this rank sent in the last step, and whether they were measured (else computed)."""
        if self.zero is not None:
            return sum(c.bytes for c in self.zero.last_step_comm()), True
        grad_bytes = self.numel * (2 if self.variant.bf16_hook else self.param_bytes // self.numel)
        return 2 * (self.world - 1) * grad_bytes // self.world, False  # ring all-reduce

    @torch.no_grad()
    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Loss of the current parameters on this rank's batch (fp32), averaged over ranks."""
        self.wait()
        value = lm_loss(self.model(tokens).float(), targets).reshape(1)
        dist.all_reduce(value)
        return value.item() / self.world


def _failed(rank: int, config: WireConfig, queue: Any, exc: BaseException) -> None:
    """Print the traceback; rank 0 hands the error back (the other ranks' peers then fail too)."""
    print(f"rank {rank}, {config.name}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    if rank == 0:
        text = str(exc).splitlines()[0] if str(exc) else ""
        queue.put({"error": f"{type(exc).__name__}: {text}"})


def _converge_worker(
    rank: int, world: int, port: int, opts: WireOptions, config: WireConfig, queue: Any
) -> None:
    """Train ``config`` for ``opts.steps`` steps of the sort task; rank 0 hands back losses and params."""
    _join(rank, world, port, opts)
    try:
        start = time.perf_counter()
        runner = WireRunner(config, opts, world)
        losses, early = [], None
        for step in range(opts.steps):
            tokens, targets = opts.task.batch(step=step, rank=rank, size=opts.batch)
            losses.append(runner.step(tokens, targets).item())
            if step + 1 == EARLY:
                with runner.zero.gathered_params():  # collective
                    early = {n: p.detach().float().numpy().copy() for n, p in runner.model.named_parameters()}
        comm, _ = runner.comm_bytes()
        with runner.zero.gathered_params():  # collective; completes the last step's gathers
            params = {n: p.detach().float().numpy().copy() for n, p in runner.model.named_parameters()}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, losses)
        if rank == 0:
            queue.put(
                {
                    "params": params,
                    "early_params": early,
                    "numel": runner.numel,
                    "losses": [statistics.fmean(ls) for ls in zip(*gathered, strict=True)],
                    "comm_bytes": comm,
                    "train_s": time.perf_counter() - start,
                }
            )
    except Exception as exc:
        _failed(rank, config, queue, exc)
    finally:
        leave()


def _speed_worker(
    rank: int, world: int, port: int, opts: WireOptions, config: WireConfig, queue: Any
) -> None:
    """One configuration in fresh processes: warm up, time ``opts.steps`` steps back to back."""
    _join(rank, world, port, opts)
    try:
        tokens, targets = make_batch(opts.model, opts.batch, rank)
        runner = WireRunner(config, opts, world)
        times, cpu = timed_steps(runner, tokens, targets, opts)
        comm, measured = runner.comm_bytes()
        loss = runner.loss(tokens, targets)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"times": times, "cpu": cpu})
        if rank == 0:
            step_max = [max(ts) for ts in zip(*(g["times"] for g in gathered), strict=True)]
            queue.put(
                {
                    "params": runner.numel,
                    "step_ms": [1e3 * t for t in step_max],
                    "median_ms": 1e3 * statistics.median(step_max),
                    "cpu_ms_per_rank": 1e3 * statistics.fmean(g["cpu"] for g in gathered),
                    "comm_bytes": comm,
                    "comm_measured": measured,
                    "loss": loss,
                }
            )
    except Exception as exc:
        _failed(rank, config, queue, exc)
    finally:
        leave()


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest absolute difference between two runs' final parameters (fp32 numpy arrays by name)."""
    return max(float(abs(a[n] - b[n]).max()) for n in a)


def run_converge(opts: WireOptions) -> dict[str, Any]:
    """Every configuration once per seed, in turn, at ``opts.converge_world``; rows compared with the
    reference run of the same seed, then summarized over seeds."""
    world = opts.converge_world
    by_seed: list[dict[str, dict[str, Any]]] = []
    for seed in range(opts.seeds):
        seeded = replace(opts, seed=seed, task=opts.task._replace(seed=seed))
        runs: dict[str, dict[str, Any]] = {}
        for config in opts.variants:
            runs[config.name] = result = run_fresh(world, config, seeded, worker=_converge_worker)
            if "error" in result:
                print(f"{config.name}: failed: {result['error']}", file=sys.stderr, flush=True)
                continue
            tail = statistics.fmean(result["losses"][-TAIL:])
            print(
                f"seed {seed}, {config.name}: loss {tail:.4f} (last {TAIL}), {result['train_s']:.0f} s "
                f"({1e3 * result['train_s'] / opts.steps:.0f} ms/step), wall {result['wall_s']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        by_seed.append(runs)
    rows = [_converge_row(config, by_seed) for config in opts.variants]
    return {"world": world, "seeds": opts.seeds, "configs": rows}


def _converge_row(config: WireConfig, by_seed: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One configuration over every seed: means (and the spread of the final loss)."""
    row: dict[str, Any] = {"name": config.name, "note": config.note, "error": None}
    row.update(dtype=config.dtype, reduce_dtype=config.reduce_dtype, gather_dtype=config.gather_dtype)
    per_seed = []
    for runs in by_seed:
        r, ref, exact = runs[config.name], runs.get(REFERENCE, {}), runs.get(EXACT, {})
        if "error" in r:
            row["error"] = r["error"]
            return row
        default_bytes = runs.get("bf16", {}).get("comm_bytes")
        one = {
            "loss_tail": statistics.fmean(r["losses"][-TAIL:]),
            "loss_last": r["losses"][-1],
            "comm_bytes": r["comm_bytes"],
            "bytes_vs_default": r["comm_bytes"] / default_bytes if default_bytes else None,
            "train_s": r["train_s"],
            "numel": r["numel"],
            "losses": r["losses"],
        }
        if "params" in ref:
            one["loss_vs_ref"] = abs(one["loss_tail"] - statistics.fmean(ref["losses"][-TAIL:]))
            one["param_diff_vs_ref"] = _max_diff(r["params"], ref["params"])
            early = zip(r["losses"][:EARLY_LOSS], ref["losses"][:EARLY_LOSS], strict=True)
            one["early_loss_vs_ref"] = statistics.fmean(abs(a - b) for a, b in early)
            if r.get("early_params") is not None and ref.get("early_params") is not None:
                one["early_param_diff_vs_ref"] = _max_diff(r["early_params"], ref["early_params"])
        if "params" in exact:
            one["param_diff_vs_exact"] = _max_diff(r["params"], exact["params"])
        per_seed.append(one)
    for key in per_seed[0]:
        values = [one.get(key) for one in per_seed]
        if key == "losses" or any(v is None for v in values):
            row[key] = values if key == "losses" else None
            continue
        row[key] = statistics.fmean(values)
    tails = [one["loss_tail"] for one in per_seed]
    row["loss_tail_min"], row["loss_tail_max"] = min(tails), max(tails)
    return row


def run_speed(world: int, opts: WireOptions) -> dict[str, Any]:
    """``opts.fresh_rounds`` rounds of every configuration, in an order rotated every round."""
    variants = list(opts.variants)
    rounds: list[dict[str, dict[str, Any]]] = []
    failed: dict[str, str] = {}
    for r in range(opts.fresh_rounds):
        t = time.perf_counter()
        live = [v for v in variants if v.name not in failed]
        measured = {}
        for j in range(len(live)):
            v = live[(r + j) % len(live)]
            result = run_fresh(world, v, opts, worker=_speed_worker)
            if "error" in result:
                failed[v.name] = result["error"]
                print(f"world {world}: {v.name} failed: {result['error']}", file=sys.stderr, flush=True)
            else:
                measured[v.name] = result
        rounds.append(measured)
        line = ", ".join(f"{name} {m['median_ms']:.0f}" for name, m in measured.items())
        print(f"world {world} round {r + 1}: {line} ms ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    configs = []
    for v in variants:
        if v.name in failed:
            configs.append({"name": v.name, "note": v.note, "error": failed[v.name]})
            continue
        per_round = [m[v.name] for m in rounds]
        row: dict[str, Any] = {
            "name": v.name,
            "note": v.note,
            "error": None,
            "kind": v.kind,
            "dtype": v.dtype,
            "reduce_dtype": v.reduce_dtype,
            "gather_dtype": v.gather_dtype,
            "bf16_hook": v.bf16_hook,
            "median_ms": statistics.median(m["median_ms"] for m in per_round),
            "round_ms": [m["median_ms"] for m in per_round],
            "cpu_ms_per_rank": statistics.median(m["cpu_ms_per_rank"] for m in per_round),
            "comm_bytes": per_round[0]["comm_bytes"],
            "comm_measured": per_round[0]["comm_measured"],
            "loss": statistics.median(m["loss"] for m in per_round),
            "wall_s": statistics.fmean(m["wall_s"] for m in per_round),
        }
        for base, key in (("ddp", "ratio_to_ddp"), ("ddp-bf16", "ratio_to_ddp_bf16")):
            row[key] = (
                _spread([m[v.name]["median_ms"] / m[base]["median_ms"] for m in rounds])
                if all(base in m for m in rounds)
                else None
            )
        configs.append(row)
    params = next((m["params"] for m in rounds[0].values()), 0) if rounds else 0
    return {"world": world, "params": params, "configs": configs}


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 140  # a file or pipe: do not wrap at rich's default of 80 columns
    return console


def _cell(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _ratio(spread: dict[str, Any] | None) -> tuple[str, str]:
    if spread is None:
        return "—", ""
    return f"{spread['median']:.3f}", f"{spread['min']:.2f}-{spread['max']:.2f}"


def _print_errors(console: Any, rows: list[dict[str, Any]], prefix: str = "") -> None:
    """One line per failed configuration: its exception (full tracebacks went to stderr)."""
    for row in rows:
        if row["error"] is not None:
            console.print(f"{prefix}{row['name']} failed: {row['error']}", markup=False)


def converge_report(result: dict[str, Any], opts: WireOptions) -> None:
    """The --converge table (rich) and how it was measured."""
    from rich.table import Table

    console = _console()
    table = Table(
        title=f"convergence: world {result['world']}, stage {opts.stage}, {opts.steps} steps",
        title_justify="left",
    )
    columns = ("configuration", f"loss (last {TAIL})", "(min-max over seeds)", "|Δloss| vs fp32")
    columns += (f"mean |Δloss| first {EARLY_LOSS}", f"max|Δθ| step {EARLY}", "max|Δθ| end")
    columns += (f"max|Δθ| vs {EXACT}", "sent/step rank 0 (KiB)", "/ bf16", "s")
    for name in columns:
        table.add_column(name, justify="left" if name == "configuration" else "right")
    for row in result["configs"]:
        if row["error"] is not None:
            table.add_row(row["name"], "[red]failed[/]", *["—"] * (len(columns) - 2))
            continue
        table.add_row(
            row["name"],
            f"{row['loss_tail']:.4f}",
            f"{row['loss_tail_min']:.4f}-{row['loss_tail_max']:.4f}",
            _cell(row.get("loss_vs_ref"), ".4f"),
            _cell(row.get("early_loss_vs_ref"), ".2e"),
            _cell(row.get("early_param_diff_vs_ref"), ".2e"),
            _cell(row.get("param_diff_vs_ref"), ".2e"),
            _cell(row.get("param_diff_vs_exact"), ".2e"),
            f"{row['comm_bytes'] / 1024:.1f}",
            _cell(row.get("bytes_vs_default"), ".3f"),
            f"{row['train_s']:.1f}",
        )
    console.print(table)
    _print_errors(console, result["configs"])
    for v in opts.variants:
        console.print(f"  {v.name}: {v.note}")
    m, task = opts.model, opts.task
    numel = next((r["numel"] for r in result["configs"] if r["error"] is None), 0)
    console.print(
        f"GPT {numel / 1e6:.3f}M parameters (vocab {m.vocab}, width {m.width}, {m.layers} layers, "
        f"{m.heads} heads, context {m.context}); sort task (length {task.length}, vocab {task.vocab}, "
        f"seed {task.seed}), {opts.batch} sequences per rank per step, the same on every configuration; "
        f"ZeroOptimizer(AdamW(lr={LR}, weight_decay={WEIGHT_DECAY}), stage={opts.stage}, wire_block="
        f"{opts.wire_block}, buckets {opts.bucket_mb:g} MiB); gloo on CPU ({os.cpu_count()} cores), one "
        f"thread per process. {result['seeds']} seed(s) (model initialisation and data), each row the "
        "mean over seeds, every difference taken against the reference run of the same seed. Loss: "
        f"mean over ranks; Δθ: parameters as fp32, rank 0, after {EARLY} steps and at the end; sent: "
        "last_step_comm() of the last step; s: training time of the run."
    )


def speed_report(results: list[dict[str, Any]], opts: WireOptions) -> None:
    """The --speed tables (rich), one per world size, and how they were measured."""
    from rich.table import Table

    console = _console()
    for res in results:
        table = Table(
            title=f"speed: world {res['world']}, {opts.fresh_rounds} fresh rounds", title_justify="left"
        )
        table.add_column("configuration")
        for name in ("step (ms)", "/ ddp", "(min-max)", "/ ddp-bf16", "(min-max)"):
            table.add_column(name, justify="right")
        for name in ("sent/step/rank (MiB)", "CPU ms/step/rank", "loss"):
            table.add_column(name, justify="right")
        for row in res["configs"]:
            if row["error"] is not None:
                table.add_row(row["name"], "[red]failed[/]", *["—"] * 7)
                continue
            sent = f"{row['comm_bytes'] / MB:.3f}" + ("" if row["comm_measured"] else " (computed)")
            table.add_row(
                row["name"],
                f"{row['median_ms']:.1f}",
                *_ratio(row["ratio_to_ddp"]),
                *_ratio(row["ratio_to_ddp_bf16"]),
                sent,
                f"{row['cpu_ms_per_rank']:.0f}",
                f"{row['loss']:.4f}",
            )
        console.print(table)
        _print_errors(console, res["configs"], f"world {res['world']}: ")
    for v in opts.variants:
        console.print(f"  {v.name}: {v.note}")
    m = opts.model
    params = results[0]["params"] if results else 0
    console.print(
        f"GPT {params / 1e6:.2f}M parameters (vocab {m.vocab}, width {m.width}, {m.layers} layers, "
        f"{m.heads} heads, context {m.context}), batch {opts.batch}x{m.context} tokens per rank (fixed); "
        f"ZeroOptimizer stage {opts.stage}, wire_block {opts.wire_block}; gloo on CPU ({os.cpu_count()} "
        f"cores), one thread per process. Each round runs every configuration once, in fresh processes, "
        f"in an order rotated every round: {opts.warmup} warm-up + {opts.steps} timed steps back to back, "
        "slowest rank, median over steps; ratios within the round, median over rounds (min-max). "
        f"AdamW(lr={LR}, weight_decay={WEIGHT_DECAY}, foreach=True) everywhere; buckets "
        f"{opts.bucket_mb:g} MiB. Sent: ZeroOptimizer measured (last_step_comm()), DDP computed "
        f"(ring all-reduce). Load average at the end: {os.getloadavg()[0]:.1f}."
    )


def parse(argv: list[str] | None = None) -> tuple[str, WireOptions, str | None]:
    """The mode (``"converge"`` or ``"speed"``), the options and the JSON path."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--converge", action="store_true", help="train every configuration, compare")
    mode.add_argument("--speed", action="store_true", help="step time and bytes, fresh rounds")
    p.add_argument("--steps", type=int, default=None, help="training (converge) or timed (speed) steps")
    p.add_argument("--warmup", type=int, default=None, help="--speed: warm-up steps per configuration")
    p.add_argument("--rounds", type=int, default=None, help="--speed: fresh rounds (default 3, --quick 1)")
    p.add_argument("--worlds", default="2,4", help="--speed: comma-separated world sizes (default 2,4)")
    p.add_argument("--world", type=int, default=4, help="--converge: world size (default 4)")
    p.add_argument("--seeds", type=int, default=1, help="--converge: seeds (model and data) per config")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3), help="ZeroOptimizer stage (default 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank per step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb / ZeroOptimizer bucket")
    p.add_argument("--wire-block", type=int, default=128, help="elements per scale (int8, fp8)")
    p.add_argument("--only", default=None, help="comma-separated configuration names to run")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    rounds = a.rounds if a.rounds is not None else 1 if a.quick else 3
    if rounds < 1:
        p.error("--rounds must be >= 1")
    converge = a.converge
    task = QUICK_TASK if a.quick else CONVERGE_TASK
    if converge:
        model = QUICK_MODEL if a.quick else CONVERGE_MODEL
        steps, warmup, batch = (5, 0, 4) if a.quick else (300, 0, 16)
    else:
        model = GPT_TINY if a.quick else GPT_7M
        steps, warmup, batch = (3, 1, 2) if a.quick else (10, 3, 4)
    base = CONVERGE if converge else SPEED
    variants = base
    if a.only:
        wanted = [s.strip() for s in a.only.split(",")]
        variants = tuple(v for v in base if v.name in wanted)
        if not variants:
            p.error(f"--only matched no configuration of {[v.name for v in base]}")
    if not gather_wire_supported():
        skipped = [v.name for v in variants if v.gather_dtype is not None]
        if skipped:
            print(
                f"ZeroOptimizer takes no gather_dtype here: skipping {', '.join(skipped)}",
                file=sys.stderr,
                flush=True,
            )
        variants = tuple(v for v in variants if v.gather_dtype is None)
    opts = WireOptions(
        worlds=tuple(int(w) for w in a.worlds.split(",")),
        steps=a.steps if a.steps is not None else steps,
        warmup=a.warmup if a.warmup is not None else warmup,
        bucket_mb=a.bucket_mb,
        batch=a.batch if a.batch is not None else batch,
        model=model,
        variants=variants,
        timeout_s=300.0,
        fresh_rounds=rounds,
        stage=a.stage,
        wire_block=a.wire_block,
        task=task,
        converge_world=a.world,
        seeds=a.seeds,
    )
    if converge and (opts.steps < max(EARLY, EARLY_LOSS) or opts.seeds < 1) and not a.quick:
        p.error(f"--steps must be >= {max(EARLY, EARLY_LOSS)} and --seeds >= 1")
    return ("converge" if converge else "speed"), opts, a.json


def main(argv: list[str] | None = None) -> None:
    mode, opts, path = parse(argv)
    start = time.perf_counter()
    if mode == "converge":
        converge = run_converge(opts)
        converge_report(converge, opts)
        results: Any = converge
    else:
        results = []
        for world in opts.worlds:
            t = time.perf_counter()
            results.append(run_speed(world, opts))
            print(f"world {world}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        speed_report(results, opts)
    print(f"\ntotal {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if path:
        payload = {
            "mode": mode,
            "model": opts.model._asdict(),
            "task": opts.task._asdict() if mode == "converge" else None,
            "stage": opts.stage,
            "wire_block": opts.wire_block,
            "batch": opts.batch,
            "steps": opts.steps,
            "warmup": opts.warmup,
            "rounds": opts.fresh_rounds if mode == "speed" else None,
            "bucket_mb": opts.bucket_mb,
            "gather_dtype_supported": gather_wire_supported(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
            "results": results,
        }
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
