# zeroplan.core — pure planning: no torch, no I/O.
"""The inner optimizers as the planner sees them: descriptions, implementations, step temporaries.

Its names are exported by :mod:`zeroplan.core` too.
"""
