"""``zeroplan plan`` run as a user runs it: a fresh interpreter, a wide terminal, warnings silenced."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ENV = {**os.environ, "COLUMNS": "160", "PYTHONWARNINGS": "ignore"}


def zeroplan(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``zeroplan plan ARGS`` in a fresh interpreter."""
    command = [sys.executable, "-m", "zeroplan.facade.cli", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)


def zeroplan_many(runs: dict[str, tuple[str, ...]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run several ``zeroplan plan`` commands concurrently; results by key."""
    with ThreadPoolExecutor(max_workers=(os.cpu_count() or 1) + 1) as pool:
        futures = {key: pool.submit(zeroplan, *args) for key, args in runs.items()}
        return {key: future.result() for key, future in futures.items()}


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
