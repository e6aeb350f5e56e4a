"""The base model's KV cache after a verification forward: keep the accepted path, drop the rest of the tree."""
from __future__ import annotations

import torch
from transformers import Cache


def keep_path(cache: Cache, prefix_len: int, path: torch.Tensor) -> None:
    """Keep positions [0, prefix_len) plus the tree nodes `path` (indices relative to prefix_len), in order.

    The tree was appended at prefix_len; gathering the accepted nodes into place avoids re-running the prefix.
    """
    keep = path.to(torch.long) + prefix_len
    on_device: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        device = layer.keys.device
        if device not in on_device:
            on_device[device] = keep.to(device, non_blocking=True)
        index = on_device[device]
        layer.keys = torch.cat([layer.keys[..., :prefix_len, :], layer.keys[..., index, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., :prefix_len, :], layer.values[..., index, :]], dim=-2)



def truncate(cache: Cache, length: int) -> None:
    """Drop every position from `length` on (to reuse one prefix across measurements)."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
