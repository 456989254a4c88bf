"""Rich tables that never cut a figure: split by columns where the terminal is too narrow.

[Note: narrow terminals]
Where a table is wider than the console, rich squeezes its columns and cuts what
does not fit with ``…`` (at 80 columns ``zeroplan plan`` printed ``12.5…`` for
12.548). :func:`print_table` prints a table that fits as rich always did, byte
for byte; one that does not fit is printed as consecutive tables of its columns,
each led by the table's first ``key`` columns (what names a row: the ranks, the
shard size, the group, collective and link), titled ``TITLE (i/n)``, with as
many columns in each as fit. Where the caller names the columns that begin a
section (the memory table's ``params`` and ``peak``), parts are cut between
sections, and inside a section only where it is too wide on its own. Each part
keeps the table's rows, styles and box, so a figure reads the same in every
layout. Only where the key and one more column do not fit (a terminal of some
30 columns) does rich squeeze that part.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection, Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Column, Table

__all__ = ["print_table", "split_table"]

#: The width a table is measured at to find its natural (unsqueezed) width.
_UNBOUNDED = 1 << 16
#: What ``Table.add_column`` takes of a column: its settings, not its cells.
_COLUMN_OPTIONS = tuple(f.name for f in dataclasses.fields(Column) if not f.name.startswith("_"))


def _natural_width(console: Console, table: Table) -> int:
    """The width ``table`` takes when no column is squeezed."""
    return Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum


def _columns_of(table: Table, indices: Sequence[int], title: str | None) -> Table:
    """A copy of ``table`` (its settings and rows) with only the columns at ``indices``, titled ``title``."""
    part = copy.copy(table)
    part.title = title
    part.columns = []
    part.rows = []
    for index in indices:
        column = table.columns[index]
        part.add_column(**{name: getattr(column, name) for name in _COLUMN_OPTIONS})
    cells = [list(table.columns[index].cells) for index in indices]
    for row_index, row in enumerate(table.rows):
        part.add_row(*(column[row_index] for column in cells), style=row.style, end_section=row.end_section)
    return part


def split_table(
    table: Table, width: int, console: Console, *, key: int = 1, sections: Collection[str] = ()
) -> list[Table]:
    """``table`` as tables no wider than ``width``: ``[table]`` itself where it fits.

    See [Note: narrow terminals]: ``key`` is how many leading columns every part repeats, and
    ``sections`` the headers of the columns that begin a section.
    """
    if _natural_width(console, table) <= width or len(table.columns) <= key + 1:
        return [table]
    keys = list(range(key))

    def fits(indices: list[int]) -> bool:
        return _natural_width(console, _columns_of(table, [*keys, *indices], None)) <= width

    units: list[list[int]] = []  # the sections, a section too wide on its own cut into its columns
    for index in range(key, len(table.columns)):
        if units and table.columns[index].header not in sections:
            units[-1].append(index)
        else:
            units.append([index])
    units = [unit for section in units for unit in ([section] if fits(section) else [[i] for i in section])]
    parts: list[list[int]] = [units[0]]
    for unit in units[1:]:
        if fits([*parts[-1], *unit]):
            parts[-1] += unit
        else:
            parts.append(unit)
    title = table.title if isinstance(table.title, str) else None
    return [
        _columns_of(table, [*keys, *part], title and f"{title} ({i}/{len(parts)})")
        for i, part in enumerate(parts, start=1)
    ]


def print_table(console: Console, table: Table, *, key: int = 1, sections: Collection[str] = ()) -> None:
    """Print ``table`` on ``console``, split by columns where it is wider (see [Note: narrow terminals])."""
    for part in split_table(table, console.width, console, key=key, sections=sections):
        console.print(part)
