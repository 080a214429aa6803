"""Benchmarks that ship with rtp: `rtp bench serve` (also `python -m rtp.bench serve`)."""
