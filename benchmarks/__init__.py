"""Benchmark scripts (not collected by pytest) and their shared harness (``benchmarks.harness``),
which the deep tests import too."""
