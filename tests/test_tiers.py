"""The test tiers' tables name tests that exist ([Note: test tiers] in ``tests/tiers.py``).

A renamed test would otherwise drop out of its table silently and change tier.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
import tiers

ROOT = Path(__file__).resolve().parents[1]
TABLES = {
    "STARTS_INTERPRETERS": tiers.STARTS_INTERPRETERS,
    "FAST_REPRESENTATIVES": tiers.FAST_REPRESENTATIVES,
    "NOTEBOOKS": tiers.NOTEBOOKS,
}


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


@pytest.mark.parametrize(
    "entry", [(name, e) for name, table in TABLES.items() for e in table], ids=lambda e: f"{e[0]}:{e[1]}"
)
def test_every_entry_names_an_existing_test(entry):
    _, nodeid = entry
    file, _, rest = nodeid.partition("::")
    path = ROOT / file
    if file.endswith("/"):  # a whole folder (the GPU suite)
        assert path.is_dir() and any(path.glob("test_*.py")), f"{nodeid}: no folder of tests"
        return
    assert path.is_file(), f"{nodeid}: no file {file}"
    if rest:
        function = rest.partition("[")[0]
        assert function in _test_functions(path), f"{nodeid}: {file} defines no {function}"


def test_fast_representatives_start_interpreters():
    for nodeid in tiers.FAST_REPRESENTATIVES:
        assert any(nodeid.startswith(p) or p.startswith(nodeid) for p in tiers.STARTS_INTERPRETERS), nodeid


def test_an_unlisted_test_cannot_start_an_interpreter():
    with pytest.raises(AssertionError, match="not listed in STARTS_INTERPRETERS"):
        subprocess.run(["true"], check=False)
