"""Shared set-up of the pytest-benchmark suite (see bench/README.md)."""
