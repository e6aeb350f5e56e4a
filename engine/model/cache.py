"""The base model's KV cache: buffers with room to grow, and compaction to the accepted path after verification.

transformers' DynamicCache concatenates each forward's keys and values onto the whole cache (a copy of the context
in every layer, every forward), and compacting a verified tree by concatenation copied it once more: the cost of a
round grew with the context. Here each layer writes new positions into a preallocated buffer and attention reads a
view of its first `length` positions; keep_path moves the accepted nodes down in place and shortens the length.
Both cost in proportion to the tokens they touch. A buffer that fills up is replaced by one half as large again
(copied once), so a chat can outgrow any first allocation.

Buffers may keep another dtype than the model computes in (`kv_dtype`): a GGUF base on the CPU's grouped kernels
keeps float16, as llama.cpp keeps its cache (engine.model.quant.kv_dtype), since over a long context reading the cache is
most of what a step spends (docs/models.md, "CPU kernels"). Every write rounds the same way (torch's float16
rounding) and attention widens what it reads exactly, so plain decoding and tree verification see the same keys.
"""
from __future__ import annotations

import functools

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

MIN_SPARE = 256  # positions a new or grown buffer holds beyond what it needs: a few hundred rounds before it grows


def _cached(buffer: str) -> property:
    """The first `length` positions of a layer's `buffer`; assigning a tensor makes it the buffer, all of it cached
    (transformers' DynamicLayer code assigns keys and values so)."""

    def get(layer: GrowingLayer) -> torch.Tensor | None:
        tensor = getattr(layer, buffer)
        return None if tensor is None else tensor[..., : layer.length, :]

    def set_(layer: GrowingLayer, tensor: torch.Tensor | None) -> None:
        setattr(layer, buffer, tensor)
        layer.length = 0 if tensor is None else tensor.shape[-2]

    return property(get, set_)


class GrowingLayer(DynamicLayer):
    """One layer's keys and values in buffers [B, kv_heads, capacity, head_dim]; `keys` and `values` are views of
    the first `length` positions, so transformers' code that reads or assigns them works unchanged."""

    keys = _cached("_keys")
    values = _cached("_values")

    def __init__(self, kv_dtype: torch.dtype | None = None, **kwargs):
        """kv_dtype: the buffers' dtype; None: the dtype of the first keys written."""
        self._keys = self._values = None
        self.length = 0
        self.kv_dtype = kv_dtype
        super().__init__(**kwargs)

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.kv_dtype or key_states.dtype, key_states.device
        self._keys, self._values = key_states[..., :0, :].to(self.dtype), value_states[..., :0, :].to(self.dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        """Write the new positions after the cached ones; return keys and values up to them."""
        self.write(self.length, key_states, value_states)
        self.length += key_states.shape[-2]
        return self.keys, self.values

    def write(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Put keys and values at positions [start, start + n), growing the buffers as needed; `length` stays (the
        draft head keeps a proposal's tree nodes past its committed slots this way, dropped by not counting them)."""
        end = start + key_states.shape[-2]
        self.reserve(end, key_states, value_states)
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states

    def first(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of positions [0, count), which may run past `length` into what `write` put there."""
        return self._keys[..., :count, :], self._values[..., :count, :]

    def reserve(self, end: int, keys_like: torch.Tensor, values_like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Buffers with room for `end` positions, created on first use in the dtype, device and heads of the
        `_like` tensors ([B, kv_heads, any, head_dim]); a kernel that writes them itself calls it (engine.model.fused)."""
        if not self.is_initialized:
            self.lazy_initialization(keys_like, values_like)
        if end > self.capacity:
            self._grow(end)
        return self._keys, self._values

    def _grow(self, needed: int) -> None:
        capacity = needed + max(MIN_SPARE, needed // 2)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.length

    def keep(self, start: int, index: torch.Tensor) -> None:
        """Keep positions [0, start) and then those at `index` (absolute, increasing), in order."""
        for buffer in (self._keys, self._values):
            buffer[..., start : start + len(index), :] = buffer.index_select(-2, index)
        self.length = start + len(index)


class GrowingCache(Cache):
    """A transformers Cache of GrowingLayers, one per decoder layer (created on first use), for unmodified HF models."""

    def __init__(self, kv_dtype: torch.dtype | None = None):
        super().__init__(layer_class_to_replicate=functools.partial(GrowingLayer, kv_dtype=kv_dtype))


def in_place(path: list[int]) -> bool:
    """Whether a tree path is the tree's first nodes in order (the root alone, or a chain's accepted part): kept
    where it was written."""
    return path == list(range(len(path)))


@torch.inference_mode()
def keep_path(cache: GrowingCache, prefix_len: int, path: list[int]) -> None:
    """Keep positions [0, prefix_len) plus the tree nodes `path` (indices relative to prefix_len), in order.

    The tree was appended at prefix_len; moving the accepted nodes into place avoids re-running the prefix.
    """
    layers = _growing_layers(cache)
    if in_place(path):
        for layer in layers:
            layer.length = prefix_len + len(path)
        return
    keep = torch.tensor(path) + prefix_len
    on_device: dict[torch.device, torch.Tensor] = {}
    for layer in layers:
        if layer.device not in on_device:
            on_device[layer.device] = keep.to(layer.device, non_blocking=True)
        layer.keep(prefix_len, on_device[layer.device])


@torch.inference_mode()
def truncate(cache: GrowingCache, length: int) -> None:
    """Drop every position from `length` on (to reuse one prefix across measurements)."""
    for layer in _growing_layers(cache):
        layer.length = min(layer.length, length)


def _growing_layers(cache: Cache) -> list[GrowingLayer]:
    if not all(isinstance(layer, GrowingLayer) for layer in cache.layers):
        raise TypeError("compacting the cache in place needs a GrowingCache (Target.new_cache), "
                        f"not {type(cache).__name__}")
    return cache.layers
