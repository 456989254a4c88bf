"""``zeroplan.core`` imports, plans and reports with torch made unimportable."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import zeroplan.core

_NO_TORCH = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (tried {name!r})")
            return None

    sys.meta_path.insert(0, NoTorch())
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[name]
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker did not block torch")

    import zeroplan.core
    from zeroplan.core import Topology, memory_report, plan, plan_reshard, preset_specs, lpt_whole, flat_even
    from zeroplan.core import ScalerConfig, initial_state, update

    specs = preset_specs("llama-7b", "bf16")
    zp = plan(specs, Topology(world_size=64, shard_size=8), stage=2)
    report = memory_report(zp, clipping=True)
    assert len(report.ranks) == 64 and report.ranks[0].total_bytes > 0
    plan_reshard(flat_even(specs, 8, 128), lpt_whole(specs, 4, 128))
    from zeroplan.core import activation_memory, preset_dims, recommend
    act = activation_memory(preset_dims("llama-7b"), micro_batch=1, seq_len=4096, recompute="selective")
    assert recommend(specs, 64, device_bytes=80 * 2**30, activation_bytes=act.total_bytes).best is not None
    update(initial_state(ScalerConfig()), True)
    leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not leaked, leaked
    print("ok", report.fingerprint, report.ranks[0].total_bytes)
    """
)


def test_core_works_with_torch_unimportable():
    out = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


def test_the_blocker_really_blocks():
    code = _NO_TORCH.replace("import zeroplan.core\n", "import zeroplan.core\nimport torch.nn\n", 1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "torch is blocked" in out.stderr


def _module_level_imports(tree: ast.Module) -> list[str]:
    """Names imported by statements that run at import time (not inside functions)."""
    names: list[str] = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif isinstance(node, ast.ClassDef):
                visit(node.body)
            else:
                visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return names


def test_no_core_module_imports_torch_at_module_level():
    files = sorted(
        pathlib.Path(p) for path in zeroplan.core.__path__ for p in pathlib.Path(path).glob("*.py")
    )
    assert len(files) >= 17
    offenders = []
    for file in files:
        for name in _module_level_imports(ast.parse(file.read_text(), str(file))):
            if name == "torch" or name.startswith("torch."):
                offenders.append(f"{file.name}: {name}")
    assert not offenders, offenders


def test_the_scanner_sees_module_level_imports():
    tree = ast.parse(
        "import torch\nif True:\n    from torch import nn\ndef f():\n    import torch.distributed\n"
    )
    assert _module_level_imports(tree) == ["torch", "torch"]
