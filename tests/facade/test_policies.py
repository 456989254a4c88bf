"""A mode is a policy chosen once ([Note: policies chosen once] in ``facade/mechanisms/policies.py``).

Read from the source (AST): outside the factory and the policies themselves no facade module reads a
plan's ``deterministic``, ``grad_wire`` or ``param_wire``, so a new mode cannot grow branches in
every module again. The plan says which policy (``ZeroPlan.reduction``, ``ZeroPlan.gather``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zeroplan.core import GatherKind, ReductionKind, Topology, plan, specs_from_shapes

FACADE = Path(__file__).resolve().parents[2] / "facade"
MODE_FIELDS = frozenset({"deterministic", "grad_wire", "param_wire"})

#: The modules that may read them, and why.
ALLOWED = {
    "mechanisms/policies.py": "the factory: the one place that asks which mode is on",
    "mechanisms/reduction.py": "the reduction policies (the encoded one takes its codec)",
    "mechanisms/gathering.py": "the gather policies (the encoded one takes its codec)",
    "runtime/construction.py": "passes the user's arguments into the plan (Request -> Settings)",
    "runtime/registry.py": "holds the user's arguments until the plan is made",
    "cli/plan.py": "reports the plan's options (prints them and plans once without wires to compare)",
}


def _reads(path: Path) -> list[tuple[int, str]]:
    """``(line, field)`` of each read of ``<something>.deterministic``/``.grad_wire``/``.param_wire``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in MODE_FIELDS and isinstance(node.ctx, ast.Load)
    ]


def test_no_facade_module_outside_the_policies_reads_a_mode():
    found = [
        f"{path.relative_to(FACADE).as_posix()}:{line}: .{attr}"
        for path in sorted(FACADE.rglob("*.py"))
        if path.relative_to(FACADE).as_posix() not in ALLOWED
        for line, attr in _reads(path)
    ]
    assert found == [], "ask the policy ([Note: reduction policy], [Note: gather policy]), not the plan"


def test_the_check_sees_the_reads_it_is_about():
    assert {attr for _, attr in _reads(FACADE / "mechanisms" / "policies.py")} <= MODE_FIELDS
    assert _reads(FACADE / "mechanisms" / "reduction.py")  # the encoded policy takes its codec
    assert all((FACADE / name).exists() for name in ALLOWED)


@pytest.mark.parametrize(
    ("options", "reduction", "gather"),
    [
        ({}, ReductionKind.DEFAULT, GatherKind.PLAIN),
        ({"deterministic": True}, ReductionKind.CANONICAL, GatherKind.PLAIN),
        ({"grad_wire": "int8"}, ReductionKind.ENCODED, GatherKind.PLAIN),
        ({"param_wire": "int8"}, ReductionKind.DEFAULT, GatherKind.ENCODED),
    ],
)
def test_the_plan_says_which_policy(options, reduction, gather):
    zp = plan(specs_from_shapes([(17, 257)], dtype="bfloat16"), Topology(world_size=2), **options)
    assert (zp.reduction, zp.gather) == (reduction, gather)


def test_a_shard_group_of_one_gathers_plain():
    zp = plan(specs_from_shapes([(64,)], dtype="bfloat16"), Topology(world_size=1), param_wire="int8")
    assert zp.gather is GatherKind.PLAIN
