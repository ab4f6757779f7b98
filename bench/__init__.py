"""The benchmark harness of issue 6: `python -m bench` (see docs/BENCHMARKS.md)."""
