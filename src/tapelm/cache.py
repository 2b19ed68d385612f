"""What tapelm keeps in a transformers `DynamicCache`, and how it grows.

One `TapeCacheLayer` per decoder layer, nothing else: its `keys` and `values` are transformers' own (B, Hkv, T, d)
(the keys as attention reads them: rotated for RoPE, Eᵀk for TAPE). Beside them each layer keeps what an encoding
also needs per cached token:

- the value stream attention reads, [V | E] for TAPE (E of past tokens never changes, so it is cached): one buffer
  whose first d features *are* `values` (a view), so attention reads [V | E] in one pass and nothing is copied;
- named per-token state (B, S, T, F) (`store_state`): the positions of the keys for relative biases (in layer 0),
  FoX's cumulative log forget gates, Wall's per channel, PaTH's short-convolution inputs, and a part of the value
  stream that is the same for every KV head (`SHARED_STREAM`: TAPE's E0 in the first layer), held once per token
  rather than once per head, so decoding reads it once.

Cropping, beam reordering and batch selection treat all of it like the keys. transformers' `DynamicLayer`
concatenates the whole cache with each new token; these layers write into spare capacity instead (doubling when
full). A static cache (`generate(..., cache_implementation="static")`, or a `StaticCache` passed in) gets
`FixedShapeCacheLayer`s: preallocated to its length, handing attention the whole buffers (what is not written yet is
masked) and writing at a position kept as a tensor on the device, so every decoding step sees the same shapes and a
compiled decode step (torch.compile, CUDA graphs) runs without recompiling; encodings whose cached keys must be read
as a sequence (PaTH) get preallocated `TapeCacheLayer`s that hand over only what is written. Unwritten capacity holds
zeros. `prepare_cache` swaps these layers into an empty `DynamicCache` or `StaticCache` (the ones `generate` creates
included) before anything is stored.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer
from transformers.utils.import_utils import is_tracing as tracing

_KEYS, _STREAM = "keys", "stream"
SHARED_STREAM = "shared stream"
"""The per-token state (B, 1, T, F) holding a value-stream part that is the same for every KV head, cached once."""


class TapeCacheLayer(DynamicLayer):
    """A `DynamicLayer` whose keys, values and per-token state live inside buffers with room along T: growing ones, or
    with `max_cache_len` preallocated ones of that size (a static cache)."""

    def __init__(self, max_cache_len: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.max_cache_len = max_cache_len
        self._buffers: dict[str, torch.Tensor] = {}  # name -> (B, S, capacity, F); the first `_length` rows are held
        self._length = 0
        self._value_width: int | None = None

    def _capacity(self, needed: int) -> int:
        if self.max_cache_len is None:
            return max(2 * needed, 64)
        if needed > self.max_cache_len:
            raise ValueError(
                f"the static cache holds max_cache_len={self.max_cache_len} tokens, and this step needs "
                f"{needed}; make the cache longer (generate sizes it to max_length)"
            )
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def _held(self, name: str) -> torch.Tensor:
        return self._buffers[name][..., : self._count(), :]

    def _count(self) -> int:
        """How many tokens the layer holds."""
        return self._length

    def _advance(self, tokens: int) -> None:
        self._length += tokens

    def _append(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """Write `new` after the held rows of buffer `name` and return rows [0, held + N)."""
        length = self._count()
        total = length + new.shape[-2]
        capacity = self._capacity(total)
        buffer = self._buffers.get(name)
        if new.requires_grad or (buffer is not None and buffer.requires_grad):  # in-place writes would break autograd
            held = new if buffer is None or length == 0 else torch.cat([buffer[..., :length, :], new], dim=-2)
            self._buffers[name] = held
            return held
        if buffer is None or total > buffer.shape[-2] or buffer.shape[:-2] != new.shape[:-2]:
            grown = new.new_zeros(*new.shape[:-2], capacity, new.shape[-1])  # never uninitialised memory
            if length:
                grown[..., :length, :] = buffer[..., :length, :]
            self._buffers[name] = buffer = grown
        buffer[..., length:total, :] = new
        return buffer[..., :total, :]

    def _expose(self) -> None:
        self.keys = self._held(_KEYS)
        self.values = self._held(_STREAM)[..., : self._value_width]

    def update_stream(self, key_states: torch.Tensor, stream: torch.Tensor, value_width: int):
        """Append keys (B, Hkv, N, dk) and the value stream (B, Hkv, N, F >= value_width) whose first `value_width`
        features are the values; return every key and the whole stream."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, stream[..., :value_width])
        if self._value_width not in (None, value_width):
            raise ValueError(f"a cache layer holding values of width {self._value_width} cannot take {value_width}")
        self._value_width = value_width
        self.keys = self._append(_KEYS, key_states)
        stream = self._append(_STREAM, stream)
        self.values = stream[..., :value_width]
        self._advance(key_states.shape[-2])
        return self.keys, stream

    def stream(self) -> torch.Tensor:
        """The value stream (B, Hkv, T, F) of the cached tokens; its first d features are `values`."""
        return self._held(_STREAM)

    def held_bytes(self) -> int:
        """Bytes of everything this layer holds for the cached tokens: keys, the value stream, the state."""
        return sum(self._held(name).nbytes for name in self._buffers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.update_stream(key_states, value_states, value_states.shape[-1])[0], self.values

    def store_state(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """Append per-token state (B, S, N, F) for the tokens this forward pass adds (called before their keys are
        stored, so the state's rows are [0, length + N)); return all of it."""
        return self._append(name, new)

    def state(self, name: str) -> torch.Tensor | None:
        """The state (B, S, T, F) stored under `name` for the cached tokens, or None."""
        return self._held(name) if name in self._buffers and self._count() else None

    def last_state(self, name: str) -> torch.Tensor | None:
        """The state (B, S, 1, F) stored under `name` for the last cached token, or None."""
        return self._held(name)[..., -1:, :] if name in self._buffers and self._count() else None

    def rewrite_keys(self, keys: torch.Tensor) -> None:
        """Replace every cached key by `keys` (same shape): for encodings whose cached keys change when new tokens
        arrive (PaTH). In place unless autograd needs the old ones."""
        if keys.shape != self.keys.shape:
            raise ValueError(
                f"rewrite_keys: keys of shape {tuple(keys.shape)} for a cache layer of {tuple(self.keys.shape)}"
            )
        if keys.requires_grad or self._buffers[_KEYS].requires_grad:
            self._buffers[_KEYS] = keys
        else:
            self._held(_KEYS).copy_(keys)
        self._expose()

    def _apply_rows(self, fn) -> None:
        """Replace every buffer by `fn` of its held rows (beam reordering, batch selection, repeats); a static layer
        keeps its size."""
        if self._count():
            self._buffers = {name: self._with_room(fn(self._held(name))) for name in self._buffers}
            self._expose()

    def _with_room(self, held: torch.Tensor) -> torch.Tensor:
        if self.max_cache_len is None:
            return held
        buffer = held.new_zeros(*held.shape[:-2], self.max_cache_len, held.shape[-1])
        buffer[..., : held.shape[-2], :] = held
        return buffer

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_rows(lambda held: held.index_select(0, beam_idx.to(held.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_rows(lambda held: held[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_rows(lambda held: held.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized or not self._count():
            return
        self._advance(max(tokens_to_remove, -self._count()))
        self._expose()

    def reset(self) -> None:
        super().reset()
        self._buffers, self._length, self._value_width = {}, 0, None

    def offload(self):
        raise ValueError("tapelm caches cannot be offloaded (their value streams and state stay on the device)")


class FixedShapeCacheLayer(TapeCacheLayer):
    """A static cache layer whose tensors keep their shapes from step to step: keys, values and state are the whole
    preallocated buffers (B, S, max_cache_len, F) (attention masks what is not written yet), and the write position is
    a tensor on the device, advanced in place. So a compiled decode step (torch.compile, CUDA graphs) sees the same
    shapes and addresses at every step. `get_seq_length()` returns that tensor, as transformers' static layers do."""

    is_compileable = True

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.cumulative_length: torch.Tensor | None = None  # tokens held, a 0-d long tensor on the cache's device

    def _count(self) -> int:
        return 0 if self.cumulative_length is None else int(self.cumulative_length)

    def _advance(self, tokens: int) -> None:
        self.cumulative_length.add_(tokens)

    def _held(self, name: str) -> torch.Tensor:
        return self._buffers[name]

    def _positions(self, tokens: int, device: torch.device) -> torch.Tensor:
        if self.cumulative_length is None:
            self.cumulative_length = torch.zeros((), dtype=torch.long, device=device)
            _static_address(self.cumulative_length)
        return self.cumulative_length + torch.arange(tokens, device=device)

    def _append(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """Write `new` at the layer's write position (a tensor on the device: nothing is read back to the host) and
        return the whole buffer."""
        positions = self._positions(new.shape[-2], new.device)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[:-2] != new.shape[:-2]:
            buffer = new.new_zeros(*new.shape[:-2], self.max_cache_len, new.shape[-1])
            _static_address(buffer)
        if new.requires_grad or buffer.requires_grad:  # in-place writes would break autograd
            buffer = buffer.index_copy(-2, positions, new)
        else:
            buffer.index_copy_(-2, positions, new)
        self._buffers[name] = buffer
        return buffer

    def last_state(self, name: str) -> torch.Tensor | None:
        """The state (B, S, 1, F) of the last cached token, zeros while nothing is cached: read at the device
        position, so no shape depends on how much is held."""
        if name not in self._buffers:
            return None
        last = (self.cumulative_length - 1).clamp(min=0).reshape(1)
        return self._buffers[name].index_select(-2, last) * (self.cumulative_length > 0)

    def get_seq_length(self) -> torch.Tensor | int:
        return 0 if self.cumulative_length is None else self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def _apply_rows(self, fn) -> None:
        if self._count():
            self._buffers = {name: fn(buffer) for name, buffer in self._buffers.items()}
            for buffer in self._buffers.values():
                _static_address(buffer)
            self._expose()

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = None


def _static_address(tensor: torch.Tensor) -> None:
    """Tell torch.compile the tensor keeps its address between calls (CUDA graphs then read it in place); outside
    tracing only."""
    if not tracing(tensor):
        torch._dynamo.mark_static_address(tensor)


def check_cache_type(cache: Cache | None) -> None:
    """Refuse, before any work, a cache tapelm cannot fill: `DynamicCache` (generate's default) and `StaticCache`
    (cache_implementation "static") get tapelm's layers, which hold the value stream and the per-token state beside
    the keys and values; offloaded and quantized caches cannot."""
    if cache is None:
        return
    if type(cache) not in (DynamicCache, StaticCache):
        raise ValueError(
            f"tapelm models support DynamicCache (generate's default) and StaticCache "
            f"(cache_implementation='static'), not {type(cache).__name__}"
        )
    if getattr(cache, "offloading", False):
        raise ValueError(
            "tapelm caches cannot be offloaded (their value streams and state stay on the device); use "
            "cache_implementation 'dynamic' or 'static'"
        )


def prepare_cache(cache: Cache | None, fixed_shapes: bool = True) -> None:
    """Give a `DynamicCache` or `StaticCache` whose layers are still transformers' empty ones tapelm's layers:
    growing ones, or for a static cache `FixedShapeCacheLayer`s (preallocated `TapeCacheLayer`s when the encoding
    needs its cached keys as a sequence: `fixed_shapes=False`)."""
    if type(cache) not in (DynamicCache, StaticCache) or all(
        isinstance(layer, TapeCacheLayer) for layer in cache.layers
    ):
        return
    cache.layers = [_tape_layer(layer, fixed_shapes) for layer in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = TapeCacheLayer


def _tape_layer(layer, fixed_shapes: bool):
    if layer.is_initialized:
        return layer
    if type(layer) is DynamicLayer:
        return TapeCacheLayer()
    if type(layer) is StaticLayer:
        return (FixedShapeCacheLayer if fixed_shapes else TapeCacheLayer)(max_cache_len=layer.max_cache_len)
    return layer


def has_fixed_shapes(cache: Cache | None) -> bool:
    """Whether `cache` hands attention whole fixed-size buffers (a static cache of `FixedShapeCacheLayer`s)."""
    return cache is not None and len(cache.layers) > 0 and isinstance(cache.layers[0], FixedShapeCacheLayer)


def capacity(cache: Cache) -> int:
    """The number of tokens a fixed-shape cache holds at most (the key length attention sees)."""
    return cache.layers[0].max_cache_len


def check_room(cache: Cache, new_tokens: int) -> None:
    """ValueError, before anything is written, when a fixed-shape cache cannot take `new_tokens` more (not checked
    while tracing: it reads the device's count)."""
    layer = cache.layers[0]
    if not tracing(layer.cumulative_length) and layer._count() + new_tokens > layer.max_cache_len:
        layer._capacity(layer._count() + new_tokens)


def cache_layer(cache: Cache, layer_idx: int) -> TapeCacheLayer:
    """Decoder layer `layer_idx`'s cache layer (created when the cache has fewer layers)."""
    while len(cache.layers) <= layer_idx:
        cache.layers.append(TapeCacheLayer())
    layer = cache.layers[layer_idx]
    if not isinstance(layer, TapeCacheLayer):
        raise ValueError(
            f"cache layer {layer_idx} is a {type(layer).__name__}, not one tapelm filled; pass an empty "
            f"DynamicCache (or none) to a tapelm model"
        )
    return layer


def store_keys_values(
    cache: Cache | None, layer_idx: int, keys: torch.Tensor, stream: torch.Tensor, value_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the new keys and value stream of decoder layer `layer_idx` and return all of them (as given without a
    cache)."""
    if cache is None:
        return keys, stream
    return cache_layer(cache, layer_idx).update_stream(keys, stream, value_width)


def key_positions(cache: Cache | None, query_positions: torch.Tensor) -> torch.Tensor:
    """Positions (B, T) of all keys: the cached ones followed by the new queries' (which are stored, in layer 0)."""
    return store_state(cache, 0, "positions", query_positions[:, None, :, None])[:, 0, :, 0]


def cached_state(cache: Cache | None, layer_idx: int, name: str) -> torch.Tensor | None:
    """The per-token state (B, S, T, F) decoder layer `layer_idx` stored under `name`, or None."""
    if cache is None or len(cache.layers) <= layer_idx:
        return None
    return cache_layer(cache, layer_idx).state(name)


def last_cached_state(cache: Cache | None, layer_idx: int, name: str) -> torch.Tensor | None:
    """The state (B, S, 1, F) decoder layer `layer_idx` stored under `name` for the last cached token, or None (a
    fixed-shape cache gives zeros while it holds nothing)."""
    if cache is None or len(cache.layers) <= layer_idx:
        return None
    return cache_layer(cache, layer_idx).last_state(name)


def store_state(cache: Cache | None, layer_idx: int, name: str, new: torch.Tensor) -> torch.Tensor:
    """Append per-token state `new` (B, S, N, F) beside decoder layer `layer_idx`'s keys and return all of it
    (B, S, T + N, F); without a cache, `new` itself. The state keeps its own dtype (e.g. float32 in a bf16 model)."""
    if cache is None:
        return new
    return cache_layer(cache, layer_idx).store_state(name, new)


def cached_keys(cache: Cache | None, layer_idx: int) -> torch.Tensor | None:
    """The keys (B, Hkv, T, d) decoder layer `layer_idx` has cached, or None."""
    if cache is None or len(cache.layers) <= layer_idx:
        return None
    layer = cache.layers[layer_idx]
    return layer.keys if layer.is_initialized and layer.get_seq_length() > 0 else None


def rewrite_keys(cache: Cache, layer_idx: int, keys: torch.Tensor) -> None:
    """Replace every cached key of decoder layer `layer_idx` by `keys` (same shape): PaTH's keys change as tokens
    arrive."""
    cache_layer(cache, layer_idx).rewrite_keys(keys)
