"""`tapelm doctor`, the one command for a visit to a GPU machine, and its pytest supervisor: the law tests in pytest
processes followed as they run, each fast path's first call, and the benchmarks and runs it records.

May import the model, training/, experiments/ and bench/ (its speed part runs `tapelm bench speed`)."""
