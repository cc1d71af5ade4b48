"""Benchmarks and the long crash campaign. Run from the repository root as modules:
``python -m bench.run``, ``python -m bench.gen``, ``python -m bench.crash_campaign``."""
