"""Optimizer state in and out: the state codec, state dicts, loading with agreement, re-sharding,
parked state."""
