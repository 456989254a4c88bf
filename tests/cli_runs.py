"""The ``zeroplan`` command line run as a user runs it, in process: ``main(argv)`` with a wide terminal,
warnings silenced, stdout and stderr captured. A few tests start the console script itself (see
``tests/test_cli_plan.py``); everything else runs here, without the cost of a fresh interpreter."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from unittest import mock

import pytest

from zeroplan.facade.cli import main

ENV = {**os.environ, "COLUMNS": "160", "PYTHONWARNINGS": "ignore"}


def run_cli(*argv: str, columns: int = 160) -> subprocess.CompletedProcess[str]:
    """``zeroplan ARGV`` in this process, as a ``CompletedProcess`` (exit code, stdout, stderr).

    ``COLUMNS`` is set while it runs, so ``rich`` lays tables out for that terminal width; an
    ``argparse`` exit (bad arguments, ``--help``) becomes the exit code, as in the console script.
    """
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, {"COLUMNS": str(columns)}),
        warnings.catch_warnings(),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        warnings.simplefilter("ignore")
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = 0 if exc.code is None else int(exc.code)  # argparse exits with 0 or 2
    return subprocess.CompletedProcess(["zeroplan", *argv], code, out.getvalue(), err.getvalue())


def zeroplan(*args: str) -> subprocess.CompletedProcess[str]:
    """``zeroplan plan ARGS``, in process."""
    return run_cli("plan", *args)


class LazyRuns(Mapping[str, subprocess.CompletedProcess[str]]):
    """Runs by key, each started the first time a test asks for it (then kept).

    A module fixture returns one, so a test tier that selects a few of a module's tests runs only
    their commands.
    """

    def __init__(
        self, runs: Mapping[str, tuple[str, ...]], run: Callable[..., subprocess.CompletedProcess[str]]
    ):
        self._args = dict(runs)
        self._run = run
        self._done: dict[str, subprocess.CompletedProcess[str]] = {}

    def __getitem__(self, key: str) -> subprocess.CompletedProcess[str]:
        if key not in self._done:
            self._done[key] = self._run(*self._args[key])
        return self._done[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._args)

    def __len__(self) -> int:
        return len(self._args)


def zeroplan_many(runs: Mapping[str, tuple[str, ...]]) -> LazyRuns:
    """Several ``zeroplan plan`` commands by key, each run when first read."""
    return LazyRuns(runs, zeroplan)


#: Marks a test that builds a model from a Hugging Face config (skipped without transformers).
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


def plan_in_process(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``zeroplan plan ARGS`` and ``... --json`` in one fresh interpreter; it prints both exit codes
    and the torch modules it imported (``[0, 0] []`` when planning needed no torch)."""
    code = (
        "import contextlib, io, sys\n"
        "from zeroplan.facade.cli import main\n"
        f"args = ['plan', *{args!r}]\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    codes = [main(args), main([*args, '--json'])]\n"
        "print(codes, sorted(m for m in sys.modules if m.partition('.')[0] == 'torch'))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
