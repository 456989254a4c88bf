"""Every ``torch.distributed`` communication call of the library is issued from
``facade/mechanisms/collectives.py`` ([Note: one place for collectives]); the demo's own training loop is
user code and may call torch itself.

Read from the source (AST), so a call added anywhere else fails here before it can escape a new wire
format or summation order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch.distributed as dist

FACADE = Path(__file__).resolve().parents[2] / "facade"
HOME = FACADE / "mechanisms" / "collectives.py"
USER_CODE = (FACADE / "cli" / "demo" / "train.py",)

#: Names of torch.distributed that move data or synchronize ranks (not queries such as get_rank).
COMMUNICATION = frozenset(
    name
    for name in dir(dist)
    if name.startswith(("all_", "reduce", "broadcast", "scatter", "gather", "barrier", "monitored_barrier"))
    or name in {"send", "recv", "isend", "irecv", "batch_isend_irecv"}
) - {"reduce_op"}


def _calls(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of each use of ``dist.NAME`` / ``torch.distributed.NAME`` in ``path``: a call, or
    the function handed on (``partial(dist.all_reduce, ...)``), which is how collectives.py calls them."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in COMMUNICATION:
            if ast.unparse(node.value) in ("dist", "torch.distributed"):
                found.append((node.lineno, node.attr))
    return found


def test_the_names_checked_include_the_collectives_the_library_uses():
    assert {"all_reduce", "all_gather", "all_gather_single", "broadcast", "isend", "irecv"} <= COMMUNICATION
    assert {"reduce_scatter", "reduce_scatter_single", "barrier", "all_gather_object"} <= COMMUNICATION
    assert "get_rank" not in COMMUNICATION


def test_only_collectives_py_calls_torch_distributed():
    elsewhere = [
        f"{path.relative_to(FACADE.parent)}:{line}: dist.{name}"
        for path in sorted(FACADE.rglob("*.py"))
        if path != HOME and path not in USER_CODE
        for line, name in _calls(path)
    ]
    assert elsewhere == [], "issue these through zeroplan.facade.mechanisms.collectives"


def test_the_check_sees_the_calls_it_is_about():
    assert len(_calls(HOME)) >= 10  # the home module's own calls are found
    assert _calls(USER_CODE[0])  # and so are the demo's


#: What places work on CUDA streams or orders them ([Note: streams] keeps these in collectives.py).
STREAM_WORDS = frozenset(
    {
        "Stream",
        "stream",
        "current_stream",
        "wait_stream",
        "wait_event",
        "record_stream",
        "record_event",
        "Event",
    }
)


def _stream_uses(path: Path) -> list[tuple[int, str]]:
    return [
        (node.lineno, node.attr)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr in STREAM_WORDS
    ]


def test_only_collectives_py_handles_streams():
    elsewhere = [
        f"{path.relative_to(FACADE.parent)}:{line}: .{name}"
        for path in sorted(FACADE.rglob("*.py"))
        if path != HOME and path not in USER_CODE
        for line, name in _stream_uses(path)
    ]
    assert elsewhere == [], "order streams through zeroplan.facade.mechanisms.collectives ([Note: streams])"
    assert {name for _, name in _stream_uses(HOME)} >= {"wait_stream", "wait_event", "current_stream"}
