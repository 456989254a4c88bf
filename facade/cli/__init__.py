"""The ``zeroplan`` command line: ``zeroplan plan …``, ``zeroplan demo …``, ``export`` and ``inspect``.

The subcommands are :mod:`zeroplan.facade.cli.plan`, :mod:`zeroplan.facade.cli.demo` and
:mod:`zeroplan.facade.cli.export_command` (``export`` and ``inspect``);
``python -m zeroplan.facade.cli`` runs :func:`main` as the console script does. Nothing here
imports torch, so ``zeroplan plan`` starts quickly.

Bad arguments, and bad or partial checkpoints, print one line, ``zeroplan: error: …``, and
exit with code 2.
``zeroplan plan --recommend`` exits with code 1 when no configuration fits
(see [Note: fit options] in :mod:`zeroplan.facade.cli.fit_command`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from zeroplan.core import CheckpointError, ConfigError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"zeroplan: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand registered."""
    from zeroplan.facade.cli import demo, export_command, plan

    parser = _Parser(prog="zeroplan", description="Plan and run ZeRO-sharded optimizers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan.register(sub)
    demo.register(sub)
    export_command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zeroplan`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (ConfigError, CheckpointError) as exc:
        message = " ".join(str(exc).split())  # always exactly one line
        print(f"zeroplan: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
