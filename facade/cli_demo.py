"""``zeroplan demo``: placeholder until the optimizer exists."""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    """Nothing registered yet."""
    del sub
