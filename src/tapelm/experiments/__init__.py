"""The experiment harness: seeded tasks, the accelerate training loop, presets, runs, evaluation, comparison.

May import the model (tapelm.config, modeling, attention, cache, positional), nothing above it."""
