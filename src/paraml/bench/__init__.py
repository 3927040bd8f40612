"""Benchmarks: the timing harness (interleaved windows, median ratios) and the ``paraml bench`` command."""

__all__: list[str] = []
