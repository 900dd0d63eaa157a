"""``saltserve bench``: benchmarks an operator runs against a server (docs/benchmarks.md)."""
