"""Benchmarks: they print their figures and are not tests. Run from the repository root."""
