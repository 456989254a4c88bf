"""Hypothesis property suite of zeroplan's planner (run: ``python -m pytest property_tests``)."""
