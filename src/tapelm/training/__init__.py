"""The run machinery any part uses: the training loop and its step, settings and schedules, checkpoints,
accelerator set-up, trackers, devices, provenance and launchers. Nothing task-specific.

May import the model (tapelm's top-level modules, positional/, kernels/), nothing above it."""
