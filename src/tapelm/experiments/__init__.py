"""The experiment harness: seeded tasks, presets, runs, evaluation, comparison, stages, claims and the report's plan.

May import the model (tapelm.config, modeling, attention, cache, positional) and training/ (the run machinery),
nothing above them."""
