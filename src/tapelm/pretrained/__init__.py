"""Pretrained models: named sources, Llama-family -> TAPE conversion, fine-tuning methods, their data and
evaluation.

May import the model and the experiment harness (for its training loop and tasks)."""
