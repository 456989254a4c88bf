"""Every place the library puts a tensor on the CPU on purpose, listed with its reason (issue 32).

A domain with no trainable parameter once fell back to CPU control tensors, which then entered NCCL
collectives (NCCL takes no CPU tensor): a crash CPU tests cannot see, since there everything is on the
CPU. Every tensor a collective takes is now made on the parameters' device (``Installed.device``,
``Shards.device``); a CPU tensor is made on purpose only where it never enters a collective, or enters
only an object collective (pickled, whose tensors torch places itself). Read from the source: a new
``"cpu"`` in the library fails here until it is listed with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

FACADE = Path(__file__).resolve().parents[2] / "facade"

#: (file, enclosing function) -> why a CPU tensor is right there.
ALLOWED = {
    ("mechanisms/collectives.py", "to_device"): "the host side of a pinned copy to the device",
    ("mechanisms/collectives.py", "to_host"): "HostStaging: copies to the host, none enters a collective",
    ("runtime/construction.py", "check_transport"): "a device-type test, no tensor",
    ("mechanisms/reduction.py", "_transported_by_gloo"): "a device-type test, no tensor",
    (
        "runtime/installed.py",
        "install",
    ): "device-type tests: which roles may live in host memory beside a GPU",
    (
        "mechanisms/buffer_devices.py",
        "buffer_device",
    ): "host residence: offload's roles in pinned host memory beside a GPU, which no collective takes "
    "(install refuses the buffers collectives run on there; [Note: offload, executed])",
    ("state/shards.py", "state_beside"): "state of masters stepped in host memory moves there: no collective",
    (
        "runtime/registry.py",
        "plan",
    ): "the inner optimizer described on the CPU where offload steps it: no tensor",
    ("state/parked.py", "gather_parked"): "parked state travels pickled (an object collective)",
    ("state/tree.py", "describe_state"): "scalar state described for an object collective",
    ("state/shards.py", "move_shards"): "scalars and whole-parameter state travel pickled",
    ("checkpoint/consolidate.py", "consolidated_state_dict"): "the consolidated result is built on the host",
    ("checkpoint/consolidate.py", "_join_slices"): "tp slices joined on the host; chunks go on the device",
    ("checkpoint/full_dicts.py", "gather_full"): "a full dict with cpu_offload is built on the host",
    ("checkpoint/interchange.py", "_to_host"): "cpu_offload of a dict's pieces: no collective",
    ("checkpoint/files.py", "__init__"): "a shard file is read to the host, then copied to the device",
    ("diagnostics/activation_trace.py", "trace_activations"): "a trace's default device: no collective",
    ("diagnostics/activation_trace.py", "_replicable"): "a device-type test (CPU only), no tensor",
}


def _cpu_uses() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(FACADE.rglob("*.py")):
        rel = str(path.relative_to(FACADE))
        if rel.startswith("cli/"):  # the demo's own training loop is user code
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Constant) and node.value == "cpu":
                    found.add((rel, func.name))
    return found


def test_every_cpu_tensor_of_the_library_has_a_listed_reason():
    unlisted = sorted(_cpu_uses() - set(ALLOWED))
    assert unlisted == [], (
        f"a CPU tensor here may enter an NCCL collective; list it with its reason: {unlisted}"
    )


def test_the_list_has_no_stale_entries():
    assert sorted(set(ALLOWED) - _cpu_uses()) == []
