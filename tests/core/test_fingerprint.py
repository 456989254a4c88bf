"""``digest``: the stable hash behind every ``fingerprint()``."""

from __future__ import annotations

import hashlib

from zeroplan.core.fingerprint import digest


def test_golden_values():
    # sha256 over the kind and the repr of each part, joined by \x1f, first 16 hex digits.
    # These literals pin the scheme: changing it changes every fingerprint ranks compare.
    assert digest("x", [1, "a", (2, 3)]) == "fe25f9ff9f075a13"
    assert digest("x", []) == "2d711642b726b044" == hashlib.sha256(b"x").hexdigest()[:16]


def test_kind_order_and_values_matter():
    base = digest("x", [1, "a", (2, 3)])
    assert digest("y", [1, "a", (2, 3)]) != base
    assert digest("x", ["a", 1, (2, 3)]) != base
    assert digest("x", [1, "a", (2, 4)]) != base
    assert digest("x", [1, "a", 2, 3]) != base  # structure, not just the flat values
    assert digest("x", [True]) != digest("x", [1])
    assert digest("x", ["1"]) != digest("x", [1])


def test_shape():
    value = digest("partition/v1", [4096, 128])
    assert len(value) == 16 and int(value, 16) >= 0 and value == value.lower()
