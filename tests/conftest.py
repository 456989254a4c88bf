"""Test tiers by cost, and the helpers beside the tests made importable.

[Note: test tiers]
Every test runs in ``.ci/run``; a developer runs the fast tier while working. What a test costs
decides its tier, applied here at collection, never by hand in a test:

* ``multiprocess``: runs collectives in the worker pools (the ``pools`` fixture). The first
  parametrized case of each test function stays in the fast tier (every multi-process behaviour is
  checked there once); the other cases are marked ``full``.
* ``subprocess``: starts fresh interpreters or launchers (torchrun, the console script, fault and
  exit jobs, the demo), as listed in ``tests/tiers.py`` (a test that starts one unlisted fails).
  Marked ``full``, except ``FAST_REPRESENTATIVES``: one run of the console script, one demo, one
  ``ZeroTrainer`` run, the import checks.
* ``notebook``: executes a notebook. Marked ``full``.

Everything else (core, doctests, unit tests of the facade) is fast. The Hypothesis suite runs in both
tiers: at the small ``fast`` profile in the fast tier and at the ``ci`` profile in the full tier
(``property``, applied in ``property_tests/conftest.py``). The commands are in the README::

    python -m pytest -m "not full" --hypothesis-profile=fast   # fast tier
    python -m pytest -m "full or property"                     # full tier

``docs/testing.md`` has the measured times of both.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiers import FAST_REPRESENTATIVES, NOTEBOOKS, STARTS_INTERPRETERS


def _starts(nodeid: str, prefixes: tuple[str, ...]) -> bool:
    return any(nodeid == p or nodeid.startswith(p) for p in prefixes)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by what it costs and move the costly ones to the full tier ([Note: test tiers])."""
    del config
    seen_functions: set[str] = set()
    for item in items:
        nodeid = item.nodeid
        function = nodeid.partition("[")[0]
        full = False
        if "pools" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)
            full = function in seen_functions
            seen_functions.add(function)
        if _starts(nodeid, STARTS_INTERPRETERS):
            item.add_marker(pytest.mark.subprocess)
            full = full or not _starts(nodeid, FAST_REPRESENTATIVES)
        if _starts(nodeid, NOTEBOOKS):
            item.add_marker(pytest.mark.notebook)
            full = True
        if full:
            item.add_marker(pytest.mark.full)


_UNLISTED = (
    "{nodeid} started a fresh interpreter ({command}) but is not listed in STARTS_INTERPRETERS in "
    "tests/tiers.py, so the fast tier would pay for it unseen: add its node id there (and to "
    "FAST_REPRESENTATIVES if the fast tier must keep it), or run the command in process."
)


@pytest.fixture(autouse=True)
def _interpreters_are_declared(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a test that starts a fresh interpreter without being marked ``subprocess``: the tiers
    are only as right as that list ([Note: test tiers])."""
    if any(request.node.get_closest_marker(m) is not None for m in ("subprocess", "notebook")):
        return

    def refuse(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        del self, rest, kwargs
        raise AssertionError(_UNLISTED.format(nodeid=request.node.nodeid, command=args))

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
