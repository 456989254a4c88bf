"""Planning speed: how long ``plan`` + ``memory_report`` take for large models and worlds.

Not a test: run it and read the table::

    python benchmarks/plan_speed.py              # 3 repeats per case, median wall time
    python benchmarks/plan_speed.py --repeats 5
    python benchmarks/plan_speed.py --profile 100k   # cProfile one case, top functions
    python benchmarks/plan_speed.py --no-gc          # the same with the cyclic GC off
    python benchmarks/plan_speed.py --cli            # `zeroplan plan` as a whole process, see below

(Planning allocates about a million small objects for the 100k case; with the cyclic garbage
collector on, 30-50 % of its time is the collector re-scanning them. ``--no-gc`` shows the
figures without it; zeroplan itself leaves the collector alone.)

Cases (issue 2, section 5):

* ``llama-70b``: the Llama-2-70B parameter list (723 tensors, 69.0 B parameters) in bf16 for
  4,096 ranks; target < 1 s for plan + report.
* ``100k``: 100,000 tensors of deterministic, varied shapes (vectors and matrices, ~1.2 B
  parameters) in bf16 for 1,024 ranks; target < 10 s for plan + report.

``--cli`` times ``zeroplan plan --preset llama-70b --world 4096 --json`` as a whole process (the
import included; wall and CPU time, min and median of the repeats) at stages 1-3 with the default
layout, ``--shard-size 8``, ``--ranks-per-node 8`` and ``--layout interleaved`` (targets: 3 s, and
10 s interleaved; issue 41).

The in-process cases run each at stages 1, 2 and 3 with the ``flat_even`` and ``lpt_whole``
strategies (AdamW, default alignment 128 and 25 MiB buckets). Stage 3 with ``flat_even`` is the
compact plan of [Note: compact plans] (``zeroplan.core.runs``): llama-70b's 2.6 million pieces.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import platform
import pstats
import random
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from zeroplan.core import ParamSpec, Topology, memory_report, plan, preset_specs, specs_from_shapes


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    target_s: float


CASES = {
    "llama-70b": Case("llama-70b", 4096, 1.0),
    "100k": Case("100k", 1024, 10.0),
}
STAGES = (1, 2, 3)
STRATEGIES = ("flat_even", "lpt_whole")


def many_tensors(count: int = 100_000, seed: int = 0) -> tuple[ParamSpec, ...]:
    """``count`` bf16 tensors: half vectors of 1..8192, half matrices 16..128 x 64..512."""
    rng = random.Random(seed)
    shapes: list[tuple[int, ...]] = []
    for _ in range(count):
        if rng.random() < 0.5:
            shapes.append((rng.randint(1, 8192),))
        else:
            shapes.append((rng.randint(16, 128), rng.randint(64, 512)))
    return specs_from_shapes(shapes, dtype="bf16")


def specs_for(case: Case) -> tuple[ParamSpec, ...]:
    return preset_specs("llama-70b", "bfloat16") if case.name == "llama-70b" else many_tensors()


def run_once(
    specs: tuple[ParamSpec, ...], world: int, stage: int, strategy: str
) -> tuple[float, float, float, int]:
    """(plan seconds, report seconds, CPU seconds of both, buckets) of one planning."""
    cpu = time.process_time()
    started = time.perf_counter()
    zp = plan(specs, Topology(world_size=world), stage=stage, strategy=strategy, optimizer="AdamW")
    planned = time.perf_counter()
    report = memory_report(zp)
    reported = time.perf_counter()
    cpu = time.process_time() - cpu
    assert len(report.ranks) == world
    return planned - started, reported - planned, cpu, len(zp.buckets.buckets)


def benchmark(repeats: int, only: list[str]) -> bool:
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}, cyclic gc {'on' if gc.isenabled() else 'off'}; "
        f"median of {repeats} repeats (wall time; cpu = process time)"
    )
    header = (
        f"{'model':<10} {'ranks':>6} {'stage':>5} {'strategy':<11} {'params':>15} {'tensors':>8} "
        f"{'buckets':>7} {'plan s':>7} {'report s':>8} {'total s':>7} {'cpu s':>6}  target"
    )
    print(header)
    print("-" * len(header))
    ok = True
    for key in only:
        case = CASES[key]
        specs = specs_for(case)
        params = sum(s.numel for s in specs)
        for stage in STAGES:
            for strategy in STRATEGIES:
                runs = [run_once(specs, case.world, stage, strategy) for _ in range(repeats)]
                plan_s = statistics.median(r[0] for r in runs)
                report_s = statistics.median(r[1] for r in runs)
                total_s = statistics.median(r[0] + r[1] for r in runs)
                cpu_s = statistics.median(r[2] for r in runs)
                met = total_s < case.target_s
                ok &= met
                print(
                    f"{case.name:<10} {case.world:>6} {stage:>5} {strategy:<11} {params:>15,} "
                    f"{len(specs):>8,} "
                    f"{runs[0][3]:>7,} {plan_s:>7.3f} {report_s:>8.3f} {total_s:>7.3f} {cpu_s:>6.2f}  "
                    f"< {case.target_s:g} s {'ok' if met else 'MISSED'}"
                )
    return ok


#: ``--cli`` configurations: name, extra arguments, target seconds.
CLI_CASES = [
    (f"stage {stage}{name}", ["--stage", str(stage), *extra], target)
    for name, extra, target in [
        ("", [], 3.0),
        (", shard size 8", ["--shard-size", "8"], 3.0),
        (", 8 ranks per node", ["--ranks-per-node", "8"], 3.0),
        (", interleaved", ["--layout", "interleaved"], 10.0),
    ]
    for stage in STAGES
]


def cli_benchmark(repeats: int) -> bool:
    """``zeroplan plan`` for llama-70b at world 4,096 as a whole process, per configuration."""
    print(
        f"zeroplan plan --preset llama-70b --world 4096 --json, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; min and median of {repeats} (wall; cpu = user + sys of the process)"
    )
    ok = True
    for name, extra, target in CLI_CASES:
        walls, cpus = [], []
        for _ in range(repeats):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            command = [sys.executable, "-m", "zeroplan.facade.cli", "plan", "--preset", "llama-70b"]
            command += ["--world", "4096", *extra, "--json"]
            subprocess.run(command, stdout=subprocess.DEVNULL, check=True)
            walls.append(time.perf_counter() - started)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        met = min(walls) < target
        ok &= met
        print(
            f"{name:<30} wall {min(walls):6.2f} / {statistics.median(walls):6.2f} s   cpu "
            f"{min(cpus):6.2f} / {statistics.median(cpus):6.2f} s   < {target:g} s "
            f"{'ok' if met else 'MISSED'}"
        )
    return ok


def profile(key: str, stage: int, strategy: str, top: int) -> None:
    case = CASES[key]
    specs = specs_for(case)
    profiler = cProfile.Profile()
    profiler.enable()
    run_once(specs, case.world, stage, strategy)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--profile", choices=sorted(CASES), help="cProfile one case instead")
    parser.add_argument("--stage", type=int, default=2, help="stage of the profiled case")
    parser.add_argument("--strategy", default="lpt_whole", help="strategy of the profiled case")
    parser.add_argument("--top", type=int, default=25, help="functions shown by --profile")
    parser.add_argument("--no-gc", action="store_true", help="disable the cyclic garbage collector")
    parser.add_argument("--cli", action="store_true", help="time `zeroplan plan` processes instead")
    args = parser.parse_args(argv)
    if args.cli:
        return 0 if cli_benchmark(args.repeats) else 1
    if args.no_gc:
        gc.disable()
    if args.profile:
        profile(args.profile, args.stage, args.strategy, args.top)
        return 0
    return 0 if benchmark(args.repeats, args.cases) else 1


if __name__ == "__main__":
    sys.exit(main())
