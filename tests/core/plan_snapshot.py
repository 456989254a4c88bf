"""Snapshots of plans and memory reports: what a planner change must leave exactly as it was.

[Note: plan snapshot]
A planner change made for speed must not change a plan. This module plans a fixed list of
configurations (presets and small random shape sets; stages 0-3; worlds 1..4096; shard groups,
nodes, layouts, strategies, dtypes, optimizers, buckets, alignments, policies) and records for
each the plan's ``fingerprint()``, a digest of its full ``memory_report`` (every rank's fields
and comm entries, as JSON) and a digest of the plan's values read through its public API
(fragments, spaces, blocks, buckets with their pieces and copies, inner tensors, staging arenas,
a reshard plan), which covers what the fingerprint leaves out. A configuration the planner
refuses records its error instead.

``tests/core/test_plan_snapshot.py`` checks the ``small`` set against
``tests/core/data/plan_snapshot.json``. The ``big`` set (a few hundred configurations, llama-70b
at world 4096 among them) is run by hand before and after a change::

    python tests/core/plan_snapshot.py write --set big /tmp/before.json.gz   # on the old code
    python tests/core/plan_snapshot.py check --set big /tmp/before.json.gz   # on the new code

(``write`` keeps every full report in the file as well, so a mismatch can be shown.)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zeroplan.core import (
    ConfigError,
    ParamSpec,
    Span,
    StepOptions,
    Topology,
    describe_optimizer,
    memory_report,
    plan,
    plan_reshard,
    preset_specs,
    staging_arena,
)

PRESETS = ("gpt2", "llama-7b", "llama-70b", "mixtral-8x7b")
DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = (
    ("AdamW", {}),
    ("Adam", {"device": "cpu"}),
    ("SGD", {"momentum": 0.9}),
    ("SGD", {"device": "cpu"}),
    ("RMSprop", {"centered": True, "momentum": 0.5}),
    ("Adagrad", {"device": "cpu"}),
    ("NAdam", {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    ("Adafactor", {}),
    ("Muon", {}),
)


def random_specs(seed: int, count: int) -> tuple[ParamSpec, ...]:
    """``count`` parameters of varied shapes (vectors, matrices, scalars, zero-size), dtypes, groups,
    cohorts and trainability, from ``seed``."""
    rng = random.Random(seed)
    dtypes = rng.choice((("float32",), ("bfloat16",), ("float32", "bfloat16"), ("float16", "float32")))
    groups = rng.choice((1, 1, 2, 3))
    specs = []
    group = 0
    for i in range(count):
        kind = rng.random()
        if kind < 0.05:
            shape: tuple[int, ...] = (0,) if rng.random() < 0.5 else (rng.randint(1, 9), 0)
        elif kind < 0.1:
            shape = ()
        elif kind < 0.5:
            shape = (rng.randint(1, 3000),)
        else:
            shape = (rng.randint(1, 300), rng.randint(1, 300))
        if groups > 1 and rng.random() < 1 / count * groups:
            group = min(group + 1, groups - 1)
        specs.append(
            ParamSpec(
                index=i,
                name=f"p{i}",
                shape=shape,
                dtype=rng.choice(dtypes),
                group=group,
                trainable=rng.random() > 0.1,
                cohort=rng.choice((0, 0, 0, 1)),
            )
        )
    return tuple(specs)


def specs_of(model: list[Any]) -> tuple[ParamSpec, ...]:
    """The specs a configuration's ``model`` names: ``["preset", name, dtype]`` or ``["random", seed, n]``."""
    if model[0] == "preset":
        return preset_specs(model[1], model[2])
    return random_specs(model[1], model[2])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


#: Every setting a configuration has beyond its model, world and shard size, with its default.
DEFAULTS: dict[str, Any] = {
    "ranks_per_node": None,
    "stage": 2,
    "strategy": "auto",
    "layout": "auto",
    "optimizer": ["AdamW", {}],
    "alignment": 128,
    "bucket_bytes": 25 * 2**20,
    "policy": "min_bytes",
    "loss_scaling": False,
    "max_inflight_buckets": 2,
    "clipping": False,
    "overlap": True,
    "reshard_after_forward": True,
}


def short(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the settings at their defaults (as the snapshot file keeps it)."""
    default = {**DEFAULTS, "shard_size": config["world"]}
    return {key: value for key, value in config.items() if key not in default or default[key] != value}


def configurations(which: str) -> list[dict[str, Any]]:
    """The configurations of set ``which`` (``"small"`` or ``"big"``), deterministic."""
    rng = random.Random(f"plan-snapshot/{which}")
    configs: list[dict[str, Any]] = []

    def add(model: list[Any], world: int, **options: Any) -> None:
        config: dict[str, Any] = {
            "model": model,
            "world": world,
            "shard_size": options.pop("shard_size", world),
        }
        config.update({key: options.pop(key, value) for key, value in DEFAULTS.items()})
        assert not options, options
        configs.append(config)

    big = which == "big"
    # The presets at large worlds, every stage: the case of issue 26 (llama-70b, world 4096, stage 3)
    # and its neighbours. Only layouts whose pieces stay in the millions.
    cases = [(name, world) for name in PRESETS for world in (8, 64, 1024, 4096)]
    for name, world in cases if big else [("gpt2", 8), ("gpt2", 256), ("llama-7b", 16)]:
        for stage in (0, 1, 2, 3):
            add(["preset", name, "bfloat16"], world, stage=stage)
    if big:
        add(["preset", "llama-70b", "bfloat16"], 4096, stage=3, shard_size=512, ranks_per_node=8)
        add(["preset", "llama-70b", "float32"], 4096, stage=3, clipping=True, loss_scaling=True)
        add(["preset", "llama-70b", "bfloat16"], 4096, stage=3, reshard_after_forward=False, overlap=False)
        add(["preset", "llama-70b", "bfloat16"], 4096, stage=3, optimizer=["Adam", {"device": "cpu"}])
        add(["preset", "llama-70b", "bfloat16"], 4096, stage=3, strategy="lpt_whole")
        add(["preset", "llama-70b", "bfloat16"], 4096, stage=3, policy="gloo", bucket_bytes=100 * 2**20)
        add(["preset", "llama-7b", "float16"], 4096, stage=3, optimizer=["Muon", {}])
        add(["preset", "mixtral-8x7b", "bfloat16"], 2048, stage=3, shard_size=256, ranks_per_node=8)
        add(["preset", "llama-7b", "bfloat16"], 1024, stage=2, layout="interleaved")
        add(["preset", "llama-70b", "bfloat16"], 4096, stage=2, strategy="lpt_whole")
        add(["preset", "llama-70b", "bfloat16"], 4096, stage=1, layout="rank_major")
    else:
        add(["preset", "gpt2", "bfloat16"], 4096, stage=3)
        add(["preset", "gpt2", "float32"], 64, stage=3, shard_size=8, ranks_per_node=4, clipping=True)
        add(
            ["preset", "gpt2", "bfloat16"],
            1024,
            stage=3,
            shard_size=512,
            optimizer=["Adam", {"device": "cpu"}],
        )
    # Presets with every knob varied, at moderate worlds.
    for _ in range(120 if big else 16):
        name = rng.choice(PRESETS if big else ("gpt2",))
        world = rng.choice((1, 2, 3, 4, 8, 16, 32, 128, 512))
        stage = rng.choice((0, 1, 2, 3, 3))
        add(
            ["preset", name, rng.choice(DTYPES)],
            world,
            shard_size=rng.choice(_divisors(world)),
            ranks_per_node=rng.choice([None, *_divisors(world)[:4]]),
            stage=stage,
            strategy=rng.choice(("auto", "flat_even", "lpt_whole", "greedy_whole")),
            layout=rng.choice(("auto", "auto", "interleaved", "rank_major")) if world <= 32 else "auto",
            optimizer=list(rng.choice(OPTIMIZERS)),
            alignment=rng.choice((1, 8, 64, 128)),
            bucket_bytes=rng.choice((2**20, 4 * 2**20, 25 * 2**20, 100 * 2**20)),
            policy=rng.choice(("min_bytes", "gloo")),
            loss_scaling=rng.random() < 0.3,
            max_inflight_buckets=rng.choice((1, 2, 3)),
            clipping=rng.random() < 0.3,
            overlap=rng.random() < 0.8,
            reshard_after_forward=rng.random() < 0.7,
        )
    # Small random shape sets: every knob, worlds up to 4096.
    for seed in range(200 if big else 70):
        world = rng.choice((1, 2, 3, 4, 5, 6, 8, 12, 16, 64, 256, 1024, 4096))
        add(
            ["random", seed, rng.choice((1, 2, 5, 12, 40, 150))],
            world,
            shard_size=rng.choice(_divisors(world)),
            ranks_per_node=rng.choice([None, *_divisors(world)[:4]]),
            stage=rng.choice((0, 1, 2, 3, 3)),
            strategy=rng.choice(("auto", "flat_even", "flat_even", "lpt_whole", "greedy_whole")),
            layout=rng.choice(("auto", "auto", "interleaved", "rank_major")),
            optimizer=list(rng.choice(OPTIMIZERS)),
            alignment=rng.choice((1, 2, 8, 32, 128)),
            bucket_bytes=rng.choice((64, 1000, 4096, 2**14, 2**16, 2**20)),
            policy=rng.choice(("min_bytes", "gloo")),
            loss_scaling=rng.random() < 0.3,
            max_inflight_buckets=rng.choice((1, 2, 3, 4)),
            clipping=rng.random() < 0.3,
            overlap=rng.random() < 0.8,
            reshard_after_forward=rng.random() < 0.7,
        )
    return configs


class _Hasher:
    """sha256 over the ``repr`` of values fed in order (a structure digest, not a plan fingerprint)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def add(self, *values: object) -> None:
        for value in values:
            self._h.update(repr(value).encode())
            self._h.update(b"\x1e")

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:24]


def _span(s: Any) -> tuple[int, int]:
    return (s.start, s.stop)


#: Beyond this many fragments (or pieces and copies), the small set's structure digest samples.
BOUND = 20_000


def _sampled(n: int) -> list[int]:
    return sorted({0, 1 % n, n // 3, n // 2, n - 2 if n > 1 else 0, n - 1})


def structure_digest(zp: Any, *, full: bool = True) -> str:
    """Digest of the plan's values, read through the public API element by element.

    ``full``: every fragment, piece and copy; otherwise, beyond :data:`BOUND` of them,
    a deterministic sample (every sequence's length, its ends and every 97th item).
    """
    h = _Hasher()
    part = zp.partition
    n = part.shard_size

    def sample(seq: Any) -> list[Any]:
        return [len(seq), *(seq[i] for i in sorted({0, len(seq) - 1, *range(0, len(seq), 97)}) if seq)]

    h.add(part.layout, part.splits_params, sorted(part.trainable_indices), part.strategy, part.alignment)
    fragments = sum(len(f) for f in part.fragments)
    for frags in part.fragments:
        if full or fragments <= BOUND:
            h.add(len(frags), [(f.param, f.rank, _span(f.param_span), f.shard_offset) for f in frags])
        else:
            h.add(sample(frags))
        if frags:
            h.add(frags[0], frags[-1], frags[len(frags) // 2], _span(frags[-1].shard_span))
    h.add(part.block_pieces)
    ranks = range(n) if n <= 64 else _sampled(n)
    for space in part.spaces:
        h.add(space.index, space.dtype, space.params, space.param_offsets, space.numel, space.owned)
        h.add(space.shard_numel, space.buffer_numel, space.buffer_offsets, space.shard_is_region)
        h.add(
            [(b.start, b.pieces, b.shard_starts, b.numel, b.offsets, b.equal, b.gather) for b in space.blocks]
        )
        if full or len(space.runs) <= BOUND:
            h.add(
                len(space.runs), [(f.param, f.rank, _span(f.param_span), f.shard_offset) for f in space.runs]
            )
        else:
            h.add(sample(space.runs))
        h.add(len(space.by_rank))
        for r in range(n) if full else ranks:
            frags = space.by_rank[r]
            h.add(r, len(frags), [(f.param, _span(f.param_span), f.shard_offset) for f in frags])
        for r in ranks:
            h.add(space.extent(r), [(_span(p.shard_span), _span(p.buffer_span)) for p in space.pieces_of(r)])
            if space.shard_numel[r]:
                h.add(space.fragments_in(r, Span(0, space.shard_numel[r])))
                h.add(space.fragments_in(r, Span(space.shard_numel[r] // 3, space.shard_numel[r])))
            if space.shard_is_region:
                h.add(space.region(r))
    layout = zp.buckets
    h.add(layout.bucket_bytes, layout.alignment, layout.policy.value, layout.param_buckets)
    pieces = sum(len(b.pieces) + len(b.copies) for b in layout.buckets)
    for b in layout.buckets:
        h.add(b.index, b.space, _span(b.span), b.params, b.collective.value, b.numel, b.padded)
        if full or pieces <= BOUND or b.index % 97 == 0:
            h.add(len(b.pieces), [(p.rank, _span(p.shard_span), p.staging_offset) for p in b.pieces])
            h.add(len(b.copies), [(c.param, _span(c.param_span), c.staging_offset) for c in b.copies])
            h.add(b.padding())
        else:
            h.add(sample(b.pieces), sample(b.copies))
        h.add(b.piece_sizes(n))
        for r in _sampled(n):
            piece = b.piece_of(r)
            h.add(None if piece is None else (piece.rank, _span(piece.shard_span), _span(piece.staging_span)))
    for r in ranks:
        h.add(r, zp.inner_tensors(r))
        h.add(staging_arena(zp, r))
    if fragments <= 20_000:
        other = plan(zp.specs, Topology(world_size=2), stage=2, optimizer=zp.optimizers, alignment=8)
        h.add(
            plan_reshard(part, other.partition).fingerprint(),
            plan_reshard(other.partition, part).fingerprint(),
        )
    return h.hexdigest()


def report_digest(document: dict[str, Any]) -> str:
    """sha256 of the report's canonical JSON."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:24]


def record(config: dict[str, Any], *, full: bool = False, full_structure: bool = True) -> dict[str, Any]:
    """Plan ``config`` and record what the snapshot compares (see [Note: plan snapshot])."""
    name, hyper = config["optimizer"]
    try:
        optimizer = describe_optimizer(name, **hyper)
        zp = plan(
            specs_of(config["model"]),
            Topology(
                world_size=config["world"],
                shard_size=config["shard_size"],
                ranks_per_node=config["ranks_per_node"],
            ),
            stage=config["stage"],
            strategy=config["strategy"],
            optimizer=optimizer,
            alignment=config["alignment"],
            bucket_bytes=config["bucket_bytes"],
            loss_scaling=config["loss_scaling"],
            max_inflight_buckets=config["max_inflight_buckets"],
            policy=config["policy"],
            layout=config["layout"],
            options=StepOptions(
                overlap_grad_reduce=config["overlap"], reshard_after_forward=config["reshard_after_forward"]
            ),
        )
        report = memory_report(zp, clipping=config["clipping"])
    except ConfigError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    document = report.as_dict()
    out = {
        "fingerprint": zp.fingerprint(),
        "report": report_digest(document),
        "structure": structure_digest(zp, full=full_structure),
    }
    if full:
        out["full_report"] = document
    return out


def run(which: str, *, full: bool, verbose: bool = False) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for config in configurations(which):
        started = time.perf_counter()
        result = record(config, full=full, full_structure=which == "big")
        if verbose:
            print(f"{time.perf_counter() - started:7.2f} s  {json.dumps(config)}", file=sys.stderr)
        yield config, result


def _open(path: Path, mode: str) -> Any:
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else path.open(mode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("write", "check"))
    parser.add_argument("file", type=Path)
    parser.add_argument("--set", dest="which", choices=("small", "big"), default="small")
    parser.add_argument("--full", action="store_true", help="write: keep every full report too")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.action == "write":
        entries = [
            {"config": short(c), **r} for c, r in run(args.which, full=args.full, verbose=args.verbose)
        ]
        with _open(args.file, "w") as f:  # one entry a line
            f.write(f'{{"set": "{args.which}", "entries": [\n')
            f.write(",\n".join(json.dumps(e, sort_keys=True) for e in entries))
            f.write("\n]}\n")
        errors = sum(1 for e in entries if "error" in e)
        print(f"wrote {len(entries)} entries ({errors} refused) in {time.perf_counter() - started:.1f} s")
        return 0
    with _open(args.file, "r") as f:
        saved = json.load(f)["entries"]
    bad = mismatches(args.which, saved, verbose=args.verbose)
    for line in bad:
        print(line)
    elapsed = time.perf_counter() - started
    print(f"checked {len(saved)} entries: {len(bad)} mismatches, {elapsed:.1f} s")
    return 1 if bad else 0


def mismatches(which: str, saved: list[dict[str, Any]], *, verbose: bool = False) -> list[str]:
    """Where set ``which`` planned now differs from the ``saved`` entries (one line each)."""
    results = list(run(which, full=False, verbose=verbose))
    if len(results) != len(saved):
        return [f"{len(results)} configurations, the snapshot has {len(saved)}"]
    bad = []
    for i, ((config, result), entry) in enumerate(zip(results, saved, strict=True)):
        expected = {k: v for k, v in entry.items() if k not in ("config", "full_report")}
        if short(config) != short(entry["config"]) or result != expected:
            bad.append(f"entry {i}: {json.dumps(short(config))}: got {result}, expected {expected}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
