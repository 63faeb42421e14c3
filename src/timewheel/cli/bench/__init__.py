"""Benchmarks behind `timewheel bench <name>`."""
