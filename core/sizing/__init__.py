# zeroplan.core — pure planning: no torch, no I/O.
"""Sizing a job before it runs: activations, "does it fit?", the cheapest configuration, model presets.

Its names are exported by :mod:`zeroplan.core` too.
"""
