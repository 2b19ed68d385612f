"""What tapelm keeps in a transformers `Cache` besides each layer's keys and value stream.

Per decoder layer the cache holds the transformed keys and the value stream ([V | E] for TAPE, whose positional
state of past tokens never changes). Encodings with relative biases also need the positions of every cached key;
those live in one extra `DynamicLayer` after the decoder layers, so that cropping, beam reordering and batch
selection treat them exactly like the keys they belong to.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


def key_positions(cache: Cache | None, query_positions: torch.Tensor, slot: int) -> torch.Tensor:
    """Positions (B, T) of all keys: the cached ones followed by the new queries' (which are stored)."""
    if cache is None:
        return query_positions
    while len(cache.layers) <= slot:
        cache.layers.append(DynamicLayer())
    stored = query_positions[:, None, :, None]
    positions, _ = cache.layers[slot].update(stored, stored)
    return positions[:, 0, :, 0]
