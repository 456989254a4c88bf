"""The README and docs/: relative links resolve, cited design notes exist, the README stays short.

Links: every inline Markdown link or image ``[text](target)`` outside code whose target has no URL
scheme (``http:``, ``mailto:``, ...) must name an existing file or folder, relative to the file that
holds the link; a ``#anchor`` into a Markdown file (or into the same file) must name one of its
headings, by GitHub's rule: the heading's text, lower-cased, without punctuation other than hyphens
and underscores, spaces turned into hyphens, ``-1``, ``-2``, ... added to repeated headings.

Notes: a design note is defined in ``core/``, ``facade/`` or ``tests/`` (the test tiers) by a line
that is only ``[Note: NAME]`` (in a docstring, or after ``#`` in a comment); every ``[Note: NAME]``
the docs cite outside code must be defined.

The README: at most 260 lines, and each command marker that ``.ci/run`` reads alone on its line,
once, directly followed by a fenced ``bash`` block.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NOTE_PACKAGES = ("core", "facade", "tests")
README_MAX_LINES = 260
COMMAND_MARKERS = ("main-command", "test-command", "full-test-command")

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:.|\n)*?(?<!`)\1(?!`)")
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
NOTE_CITED = re.compile(r"\[Note:\s+([^\]]+?)\s*\]")
NOTE_DEFINED = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines of ``text`` with fenced code blocks blanked (line numbers kept)."""
    lines, inside = [], None
    for line in text.split("\n"):
        fence = FENCE.match(line)
        if inside is None and fence:
            inside = fence.group(1)
            lines.append("")
        elif inside is not None:
            if line.strip().startswith(inside) and line.strip().strip(inside[0]) == "":
                inside = None
            lines.append("")
        else:
            lines.append(line)
    return lines


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans."""
    return CODE_SPAN.sub(
        lambda m: " " * len(m.group(0).replace("\n", "")) + "\n" * m.group(0).count("\n"),
        "\n".join(prose_lines(text)),
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of the Markdown file ``path``."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every inline link or image in ``path``, outside code."""
    text = prose(path.read_text(encoding="utf-8"))
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in LINK.finditer(text)]


def broken_links(path: Path) -> list[str]:
    """What is wrong with each relative link of ``path``: a missing file or heading."""
    problems = []
    for line, target in links(path):
        if not target or SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{line}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def defined_notes() -> dict[str, list[str]]:
    """Every design note defined in the packages, with the files that define it."""
    notes: dict[str, list[str]] = {}
    for package in NOTE_PACKAGES:
        for source in sorted((ROOT / package).rglob("*.py")):
            for line in source.read_text(encoding="utf-8").splitlines():
                m = NOTE_DEFINED.match(line)
                if m:
                    notes.setdefault(m.group(1), []).append(str(source.relative_to(ROOT)))
    return notes


def cited_notes(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``[Note: NAME]`` that ``path`` cites outside code."""
    text = prose(path.read_text(encoding="utf-8"))
    return [
        (text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())) for m in NOTE_CITED.finditer(text)
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_notes_are_defined(path: Path) -> None:
    notes = defined_notes()
    where = path.relative_to(ROOT)
    missing = [f"{where}:{line}: [Note: {name}]" for line, name in cited_notes(path) if name not in notes]
    assert missing == [], f"cited but defined nowhere in {', '.join(NOTE_PACKAGES)}/"


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"


@pytest.mark.parametrize("name", COMMAND_MARKERS)
def test_readme_command_marker(name: str) -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    marker = f"<!-- {name} -->"
    at = [i for i, line in enumerate(lines) if line == marker]
    assert len(at) == 1, f"README.md needs {marker} alone on one line, once; found {len(at)}"
    i = at[0]
    assert i + 1 < len(lines) and lines[i + 1] == "```bash", f"{marker} must be followed by a ```bash fence"
    rest = lines[i + 2 :]
    assert "```" in rest, f"the bash block after {marker} is not closed"
    assert any(line.strip() for line in rest[: rest.index("```")]), f"the bash block after {marker} is empty"


# The checks check something: a broken link, a wrong anchor, an unknown note, a missing marker fail.


def test_checks_catch_mistakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = tmp_path.resolve()
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    headings = "# A title\n\n## The step's peak\n\n## `Trainer`\n"
    (tmp_path / "docs" / "a.md").write_text(headings, encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n"
        "[ok](docs/a.md) [ok](docs/a.md#the-steps-peak) [ok](docs/a.md#trainer) [ok](#top)\n"
        "[web](https://example.com/x) [mail](mailto:a@b.c) `[code](nowhere.md)`\n"
        "```text\n[fenced](nowhere.md)\n```\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#no-such-heading)\n[split\nacross lines](docs/c.md)\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert "docs/b.md" in problems[0] and "#no-such-heading" in problems[1] and "docs/c.md" in problems[2]
    assert slug("Aborts at exit (understood, fixed)") == "aborts-at-exit-understood-fixed"
    assert slug("[Link](x.md) and `code`: 3.5?") == "link-and-code-35"

    page.write_text("[Note: a\nnote] and `[Note: in code]`\n", encoding="utf-8")
    assert cited_notes(page) == [(1, "a note")]
    assert NOTE_DEFINED.match("    [Note: stage 3]") and NOTE_DEFINED.match("# [Note: tolerance]")
    assert not NOTE_DEFINED.match("    See [Note: stage 3].") and not NOTE_DEFINED.match("x  # [Note: y]")


def test_the_design_index_lists_every_note():
    """docs/design.md's index of notes names every note the code defines, with the files defining it."""
    index = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    rows = {
        name: sorted(re.findall(r"`([^`]+)`", cell))
        for name, cell in re.findall(r"^\| \[Note: ([^\]]+)\] \| (.+?) \|$", index, flags=re.M)
    }
    notes = defined_notes()
    missing = [f"[Note: {name}] ({', '.join(files)})" for name, files in notes.items() if name not in rows]
    assert missing == [], "add these to the index in docs/design.md"
    wrong = [
        f"[Note: {n}]: {rows[n]} != {files}"
        for n, files in notes.items()
        if n in rows and rows[n] != sorted(files)
    ]
    assert wrong == [], "the index names other files than the ones defining the note"
