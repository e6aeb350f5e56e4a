"""Which CPU linear layers a base model runs on: the float ones (oneDNN-packed, engine.model.packed) or the grouped
ones over a GGUF's blocks (engine.model.quant), on float32 or int8 activations; what `auto` means, and why a choice
cannot run here. Decided once, before any weight is read (engine.options.LoadOptions.resolved)."""
from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from . import kernels
from .load import on_gpu


class Kernels(StrEnum):
    """The kernels a base model's linear layers run on; the strings are the command line's."""

    FLOAT = "float"
    Q4 = "q4"
    INT8 = "int8"

    @property
    def grouped(self) -> bool:
        """Whether the layers keep a GGUF's groups (engine.model.quant's QuantLinear)."""
        return self is not Kernels.FLOAT


AUTO = "auto"
KERNELS = (AUTO, *(k.value for k in Kernels))  # what --kernels takes
KERNELS_HELP = ("the CPU linear layers: float = oneDNN-packed float weights; q4 = a GGUF's 4-bit groups as they are, "
                "times float32 activations; int8 = the same groups times activations rounded to 8 bits per group of "
                "32, integer products as llama.cpp computes them (another rounding of the model, the fastest; "
                "docs/models.md); auto = int8 for a GGUF base on the CPU in float32 or dtype auto, else float")


def resolve_kernels(kernels: str, device: str, dtype: str, pack: bool, quantization: str,
                    gguf: Path | None) -> Kernels:
    """Engine.load's kernels=: "float" (oneDNN-packed float layers, engine.model.packed), "q4" (QuantLinear layers: a
    GGUF base's own groups; another base quantized to Q4_1 with its LM head in Q8_0, which changes the model),
    "int8" (the same groups on int8 activations, as llama.cpp computes: another rounding again), or "auto": int8
    for a GGUF base on the CPU (dtype auto or float32) where the kernels build, the fastest (docs/benchmarks.md,
    "CPU kernels"), also where the CPU multiplies bf16 natively; float elsewhere (another base would be changed by
    quantizing it)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
    if kernels == AUTO:
        usable = gguf is not None and not grouped_unusable(device, dtype, pack, quantization)
        return Kernels.INT8 if usable else Kernels.FLOAT
    chosen = Kernels(kernels)
    reason = grouped_unusable(device, dtype, pack, quantization) if chosen.grouped else None
    if reason:
        raise ValueError(f"kernels={kernels!r} cannot run here: {reason}")
    return chosen


def grouped_unusable(device: str, dtype: str, pack: bool, quantization: str) -> str | None:
    """Why the grouped kernels cannot run a base loaded with these settings (None: they can)."""
    if not pack:
        return "pack=False keeps transformers' own layers"
    if on_gpu(device):
        return "the grouped kernels run on the CPU"
    if quantization != "none":
        return f"quantization={quantization!r} already quantizes the layers (bitsandbytes)"
    if dtype not in ("auto", "float32"):
        return f"the grouped kernels take float32 activations, not {dtype}"
    return kernels.unavailable_reason()
