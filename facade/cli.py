"""The ``zeroplan`` command line: ``zeroplan plan …`` and ``zeroplan demo …``.

Bad arguments print one line, ``zeroplan: error: …``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from zeroplan.core import ConfigError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"zeroplan: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand registered."""
    from zeroplan.facade import cli_demo, cli_plan

    parser = _Parser(prog="zeroplan", description="Plan and run ZeRO-sharded optimizers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    cli_plan.register(sub)
    cli_demo.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zeroplan`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except ConfigError as exc:
        message = " ".join(str(exc).split())  # always exactly one line
        print(f"zeroplan: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
