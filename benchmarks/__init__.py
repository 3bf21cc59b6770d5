"""Benchmarks (not collected by pytest), one entry per question: ``memory.py``, ``speed.py``,
``budget.py``, ``largest_graph.py``, ``accuracy.py`` (each with subcommands, ``--help``) and
``run_gpu_suite.sh``; their shared harness (``benchmarks.harness``), which the deep tests
import too."""
