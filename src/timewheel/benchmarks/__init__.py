"""Benchmarks run by ``timewheel bench <name>``: every figure is a ratio against a baseline of the same run."""
