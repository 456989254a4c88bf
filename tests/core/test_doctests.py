"""Every docstring example of ``zeroplan.core`` runs and passes."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import zeroplan.core

MODULES = ["zeroplan.core"] + [
    m.name for m in pkgutil.walk_packages(zeroplan.core.__path__, "zeroplan.core.")
]

#: Examples present when this test was written (61); new ones only raise the count.
MIN_EXAMPLES = 55


@pytest.fixture(scope="module")
def results() -> dict[str, doctest.TestResults]:
    """``doctest.testmod`` of every module, run once."""
    return {
        name: doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=True)
        for name in MODULES
    }


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests_pass(results, name):
    result = results[name]
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples failed in {name}"


def test_enough_examples_ran_overall(results):
    assert len(MODULES) >= 17  # the package and each of its modules
    ran = sum(result.attempted for result in results.values())
    assert ran >= MIN_EXAMPLES, f"only {ran} doctest examples ran in zeroplan.core"
