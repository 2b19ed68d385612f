"""Benchmarks of speed and memory. May import the model and the experiment harness's provenance record."""
