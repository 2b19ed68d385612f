"""What tapelm keeps in a transformers `Cache`, and how it grows.

Per decoder layer the cache holds the transformed keys and the value stream ([V | E] for TAPE, whose positional
state of past tokens never changes). Encodings with relative biases also need the positions of every cached key;
those live in one extra layer after the decoder layers (slot `num_hidden_layers`), so that cropping, beam reordering
and batch selection treat them exactly like the keys they belong to. Encodings with per-token state of their own keep
it the same way, one extra layer per decoder layer after that (`layer_state_slot`, `store_state`): FoX's cumulative log forget gates,
PaTH's short-convolution inputs.

transformers' `DynamicLayer` concatenates the whole cache with each new token, which makes every decoding step copy
everything cached so far; `GrowingLayer` writes into spare capacity instead (doubling when full). `prepare_cache`
swaps it into a `DynamicCache` (the one `generate` creates included) before anything is stored.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views into buffers with spare room along the sequence axis."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def _views_buffers(self) -> bool:
        """Whether keys/values are still the views this layer handed out (crop or reorder replace them)."""
        if self._buffers is None:
            return False
        key_buffer, value_buffer = self._buffers
        return (self.keys.data_ptr() == key_buffer.data_ptr() and self.values.data_ptr() == value_buffer.data_ptr()
                and self.keys.shape[:-2] == key_buffer.shape[:-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.requires_grad or value_states.requires_grad:  # in-place writes would break autograd
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        total = length + key_states.shape[-2]
        if not self._views_buffers() or total > self._buffers[0].shape[-2]:
            capacity = max(2 * total, 64)
            self._buffers = tuple(
                old.new_empty(*new.shape[:-2], capacity, new.shape[-1])
                for old, new in ((key_states, key_states), (value_states, value_states)))
            if length:
                self._buffers[0][..., :length, :] = self.keys
                self._buffers[1][..., :length, :] = self.values
        key_buffer, value_buffer = self._buffers
        key_buffer[..., length:total, :] = key_states
        value_buffer[..., length:total, :] = value_states
        self.keys, self.values = key_buffer[..., :total, :], value_buffer[..., :total, :]
        return self.keys, self.values


def check_cache_type(cache: Cache | None) -> None:
    """Refuse, before any work, a cache tapelm cannot fill: only `DynamicCache` (generate's default) holds the
    [V | E] value stream and the key positions."""
    if cache is not None and not isinstance(cache, DynamicCache):
        raise ValueError(f"tapelm models support only DynamicCache (generate's default cache_implementation="
                         f"'dynamic'), not {type(cache).__name__}; drop cache_implementation or pass 'dynamic'")


def prepare_cache(cache: Cache | None) -> None:
    """Give an empty `DynamicCache` growing layers (other caches are left as they are)."""
    if type(cache) is DynamicCache and cache.get_seq_length() == 0:
        cache.layers = [GrowingLayer() if type(layer) is DynamicLayer and not layer.is_initialized else layer
                        for layer in cache.layers]
        if cache.layer_class_to_replicate is DynamicLayer:
            cache.layer_class_to_replicate = GrowingLayer


def key_positions(cache: Cache | None, query_positions: torch.Tensor, slot: int) -> torch.Tensor:
    """Positions (B, T) of all keys: the cached ones followed by the new queries' (which are stored)."""
    if cache is None:
        return query_positions
    while len(cache.layers) <= slot:
        cache.layers.append(GrowingLayer())
    stored = query_positions[:, None, :, None]
    positions, _ = cache.layers[slot].update(stored, stored)
    return positions[:, 0, :, 0]


def layer_state_slot(num_layers: int, layer_idx: int) -> int:
    """The cache slot of decoder layer `layer_idx`'s per-token state: after the decoder layers and the key
    positions' slot."""
    return num_layers + 1 + layer_idx


def cached_state(cache: Cache | None, slot: int) -> torch.Tensor | None:
    """The per-token state (B, S, T, F) stored in extra cache layer `slot`, or None when nothing is stored."""
    if cache is None or len(cache.layers) <= slot:
        return None
    layer = cache.layers[slot]
    return layer.keys if layer.is_initialized and layer.get_seq_length() > 0 else None


def store_state(cache: Cache | None, slot: int, new: torch.Tensor) -> torch.Tensor:
    """Append per-token state `new` (B, S, N, F) to extra cache layer `slot` and return all of it (B, S, T + N, F);
    without a cache, `new` itself. The state keeps its own dtype (e.g. float32 in a bf16 model)."""
    if cache is None:
        return new
    while len(cache.layers) <= slot:
        cache.layers.append(GrowingLayer())
    stored, _ = cache.layers[slot].update(new, new[..., :0])
    return stored


def cached_keys(cache: Cache | None, layer_idx: int) -> torch.Tensor | None:
    """The keys (B, Hkv, T, d) decoder layer `layer_idx` has cached, or None."""
    if cache is None or len(cache.layers) <= layer_idx:
        return None
    layer = cache.layers[layer_idx]
    return layer.keys if layer.is_initialized and layer.get_seq_length() > 0 else None


def rewrite_keys(cache: Cache, layer_idx: int, keys: torch.Tensor) -> None:
    """Replace every cached key of decoder layer `layer_idx` by `keys` (same shape): for encodings whose cached keys
    change when new tokens arrive (PaTH). In place when the layer's keys are its own buffer."""
    layer = cache.layers[layer_idx]
    if keys.shape != layer.keys.shape:
        raise ValueError(f"rewrite_keys: keys of shape {tuple(keys.shape)} for a cache layer of {tuple(layer.keys.shape)}")
    if isinstance(layer, GrowingLayer) and layer._views_buffers() and not keys.requires_grad:
        layer.keys.copy_(keys)
    else:
        layer.keys = keys
