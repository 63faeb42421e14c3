"""Benchmarks behind ``timewheel bench``, and the baselines they compare against."""
