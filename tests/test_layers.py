"""The facade's layers: every import points down ([Note: facade layers] in ``zeroplan.facade``).

Read from the source with the same import graph as ``test_import_cycles`` (imports under
``TYPE_CHECKING`` and inside functions included): a module may import ``zeroplan.core`` and facade
modules of its own layer or a lower one, never a higher one.
"""

from __future__ import annotations

import pytest
from test_import_cycles import import_graph, modules

#: Layer of each facade package, lowest first: the mechanisms, the parameters and the state they
#: hold, the step with its services (checkpoints, diagnostics), then the entry points.
LAYERS = {
    "zeroplan.facade.mechanisms": 0,
    "zeroplan.facade.params": 1,
    "zeroplan.facade.state": 2,
    "zeroplan.facade.runtime": 3,
    "zeroplan.facade.checkpoint": 3,
    "zeroplan.facade.diagnostics": 3,
    "zeroplan.facade.cli": 4,
    "zeroplan.facade.hf": 4,
    "zeroplan.facade.pipelining": 4,
    "zeroplan.facade": 4,
}


def layer(module: str) -> int | None:
    """The layer of a facade module (its longest package prefix), ``None`` for core."""
    if not module.startswith("zeroplan.facade"):
        return None
    return next(
        LAYERS[p] for p in sorted(LAYERS, key=len, reverse=True) if module == p or module.startswith(p + ".")
    )


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge of ``graph`` from a facade module to one of a higher layer."""
    found = []
    for name, targets in sorted(graph.items()):
        mine = layer(name)
        for target in sorted(targets):
            theirs = layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{name} (layer {mine}) imports {target} (layer {theirs})")
    return found


def test_every_facade_package_has_a_layer():
    packages = {".".join(name.split(".")[:3]) for name in modules() if name.startswith("zeroplan.facade.")}
    assert packages <= LAYERS.keys(), sorted(packages - LAYERS.keys())


def test_imports_point_down():
    assert upward_imports(import_graph(modules())) == []


def test_the_rule_catches_an_upward_import():
    graph = {
        "zeroplan.facade.mechanisms.collectives": {"zeroplan.core.planner", "zeroplan.facade.runtime.joint"},
        "zeroplan.facade.state.tree": {"zeroplan.facade.params.buffers", "zeroplan.facade.mechanisms.groups"},
        "zeroplan.facade.params.residency": {"zeroplan.facade.state.inner"},
        "zeroplan.facade.runtime.joint": {"zeroplan.facade.checkpoint.root", "zeroplan.facade.cli"},
    }
    assert upward_imports(graph) == [
        "zeroplan.facade.mechanisms.collectives (layer 0) imports zeroplan.facade.runtime.joint (layer 3)",
        "zeroplan.facade.params.residency (layer 1) imports zeroplan.facade.state.inner (layer 2)",
        "zeroplan.facade.runtime.joint (layer 3) imports zeroplan.facade.cli (layer 4)",
    ]


def test_every_package_is_installed():
    # A non-editable install (CI's) ships only the packages pyproject.toml lists.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from test_import_cycles import PACKAGES, ROOT

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join([PACKAGES[folder], *init.parent.relative_to(ROOT / folder).parts])
        for folder in PACKAGES
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found == listed


def test_one_module_per_file_name_and_one_class_per_name():
    # A newcomer finds a module by its file name and a class by its name ([Note: facade layers]).
    import ast
    from collections import Counter

    paths = list(modules().values())
    names = Counter(p.name for p in paths if p.name != "__init__.py")
    assert [n for n, c in names.items() if c > 1] == []
    classes = Counter(
        node.name
        for p in paths
        for node in ast.parse(p.read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    )
    assert [n for n, c in classes.items() if c > 1] == []
