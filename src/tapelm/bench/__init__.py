"""Benchmarks of speed and memory. May import the model, training/ (the provenance record) and experiments/."""
