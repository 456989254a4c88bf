"""Every notebook in ``notebooks/`` executes without error and draws its plots.

Notebooks are stored with their outputs cleared (small diffs); this test runs them in a fresh
kernel of the interpreter running pytest (``ipykernel``, ``matplotlib``, ``nbclient`` and
``nbformat`` come with the ``test`` extra), headless (``MPLBACKEND=Agg``), and checks that every
``## `` section produced at least one image, unless its heading cell is tagged ``no-image``, and
that every plot is followed by a markdown cell that reads it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL = "python3"
NO_IMAGE_TAG = "no-image"


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} have stored outputs; clear them before committing "
        f"(jupyter nbconvert --clear-output --inplace {path.name})"
    )


def _use_this_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the ``python3`` kernel run ``sys.executable``, whatever other kernelspecs exist.

    ``JUPYTER_PATH`` comes first in the kernelspec search path, ahead of any user-level
    ``python3`` kernelspec that might point at another interpreter.
    """
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")


def _has_image(cell: dict) -> bool:
    return any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def _sections(nb) -> list[tuple[int, list[dict]]]:
    """``(index of the heading cell, cells)`` for every ``## `` section."""
    sections: list[tuple[int, list[dict]]] = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("## "):
            sections.append((i, [cell]))
        elif sections:
            sections[-1][1].append(cell)
    return sections


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _use_this_interpreter(tmp_path, monkeypatch)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=600,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails

    sections = _sections(nb)
    assert sections, f"{path.name} has no '## ' sections"
    missing = [
        nb.cells[head].source.splitlines()[0]
        for head, cells in sections
        if NO_IMAGE_TAG not in nb.cells[head].metadata.get("tags", [])
        and not any(_has_image(c) for c in cells)
    ]
    assert not missing, f"{path.name}: sections without a plot: {missing}"

    unread = [
        i
        for i, cell in enumerate(nb.cells)
        if _has_image(cell) and (i + 1 == len(nb.cells) or nb.cells[i + 1].cell_type != "markdown")
    ]
    assert not unread, f"{path.name}: plots in cells {unread} are not followed by a markdown reading"
