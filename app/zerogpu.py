"""Hugging Face ZeroGPU: run a function under `spaces.GPU` when the `spaces` package is installed.

Import this module before torch: on ZeroGPU hardware `spaces` must patch CUDA first. Elsewhere `spaces.GPU`
leaves the function as it is, and without the package nothing changes at all.
"""
from __future__ import annotations

from typing import Callable, TypeVar

try:
    import spaces
except ImportError:
    spaces = None

F = TypeVar("F", bound=Callable)


def on_gpu(function: F) -> F:
    return spaces.GPU(function) if spaces is not None else function
