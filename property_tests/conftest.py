"""Hypothesis profiles, the ``--strategy`` option and the ``strategy_name`` parametrization.

Profiles (pick with ``--hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE``; default ``ci``):

* ``fast`` — the fast test tier's: reproducible like ``ci``, with a sixth of its examples, so the
  suite takes well under a minute ([Note: test tiers] in ``tests/conftest.py``);
* ``ci``  — reproducible (``derandomize=True``, no example database) and sized so the
  whole suite stays within about three minutes on two cores; the full tier runs it;
* ``dev`` — more, randomized examples with the local example database, for hunting bugs.

Every test here is marked ``property``: the full tier selects them again (``-m "full or property"``)
to run them at the ``ci`` profile.

Strategies under test: every test that takes a ``strategy_name`` argument runs once per
partition strategy. Without options these are all registered strategies
(``zeroplan.core.strategy_names()``); with one or more ``--strategy MODULE:FUNCTION`` (or
``path/to/file.py:FUNCTION``) only the given ones, each registered first::

    python -m pytest property_tests --strategy mypkg.mymod:my_strategy
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from zeroplan.core import get_strategy, register_strategy, strategy_names

# The repository root, so that `property_tests.strategies` and user modules given to
# --strategy import the same way under `pytest` and `python -m pytest`.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

torch.set_num_threads(1)

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    stateful_step_count=50,
)
settings.register_profile(
    "fast",
    parent=settings.get_profile("ci"),
    max_examples=10,
    stateful_step_count=20,
)
settings.register_profile(
    "dev",
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    stateful_step_count=80,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_STRATEGIES = pytest.StashKey[tuple[str, ...]]()


def pytest_addoption(parser):
    parser.addoption(
        "--strategy",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="run the zeroplan property suite against this partition strategy only (repeatable); "
        "MODULE is a dotted import path or a .py file",
    )


def _load(target):
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(
            f"--strategy {target!r}: expected MODULE:FUNCTION, e.g. mypkg.strategies:round_robin"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            spec = importlib.util.spec_from_file_location(f"_zeroplan_user_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as err:
        raise pytest.UsageError(f"--strategy {target!r}: cannot import {module_name!r}: {err}") from err
    function = module
    for part in attr.split("."):
        function = getattr(function, part, None)
    if not callable(function):
        raise pytest.UsageError(f"--strategy {target!r}: {module_name!r} has no callable {attr!r}")
    return function


def _register(function):
    """The name ``function`` is registered under, registering it when it is new."""
    for name in strategy_names():
        if get_strategy(name) is function:
            return name
    name = function.__qualname__
    if name in strategy_names():
        name = f"{function.__module__}.{function.__qualname__}"
    register_strategy(name, function)
    return name


def pytest_configure(config):
    targets = config.getoption("--strategy", default=[]) or []
    names = tuple(dict.fromkeys(_register(_load(t)) for t in targets)) or strategy_names()
    config.stash[_STRATEGIES] = names


def pytest_report_header(config):
    return f"zeroplan strategies under test: {', '.join(config.stash.get(_STRATEGIES, ()))}"


def pytest_collection_modifyitems(items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.property)


def pytest_generate_tests(metafunc):
    if "strategy_name" in metafunc.fixturenames:
        metafunc.parametrize("strategy_name", metafunc.config.stash[_STRATEGIES])


@pytest.fixture(scope="session")
def strategies_under_test(request):
    """Names of every strategy under test (for properties relating two plans)."""
    return request.config.stash[_STRATEGIES]
