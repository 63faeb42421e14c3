"""Benchmarks run by ``timewheel bench <name>``; every figure is a ratio within one run."""
