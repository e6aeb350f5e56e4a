"""Where a base model is loaded: `load_target`, the one way in for the engine (Engine.from_options, so the app and
the bench) and for training (engine.train: replies, features and targets come from the model the engine decodes).

It opens the base's GGUF file once (its tensor table read once and passed on), builds the model straight onto the
grouped kernels from the file's blocks where it can (engine.model.gguf_load), else loads transformers' float copy and
moves its layers onto the chosen kernels (engine.model.gguf_match); then packs the float layers left and gives a model
wholly on the CPU the batch-invariant attention. The LoadedBase it returns is final: nothing after it quantizes the
base or chooses its kernels again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .attention import use_wide_attention
from .fused import why_not_fused
from .gguf_load import load_grouped, why_not_direct
from .gguf_match import quantize_linears
from .gguf_tensors import GgufFile
from .kernel_policy import Kernels
from .load import load_base, load_tokenizer, open_gguf
from .packed import pack_linears, packable_dtypes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetOptions:
    """What load_target reads: the base-model settings of engine.options.LoadOptions, resolved (its `target`)."""

    base: str | None
    kernels: Kernels = Kernels.FLOAT
    dtype: str = "float32"
    device: str = "cpu"
    attn: str = "sdpa"
    quantization: str = "none"
    max_memory: str | None = None
    pack: bool = True


@dataclass(frozen=True)
class LoadedBase:
    """A base model ready to decode, and what it was loaded from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kernels: Kernels
    gguf: GgufFile | None  # the GGUF file it came from, its tensor table read once
    pack: bool  # its CPU float layers packed and, wholly on the CPU, a batch-invariant attention (a head's packed too)
    exact: bool  # every row of a forward the same bits whatever the batch: tree rows are one-token steps' bits
    fused: bool  # the decoder in one kernel call (engine.model.fused): the fast exact path


def load_target(options: TargetOptions) -> LoadedBase:
    """Load the base model `options` name onto its kernels: straight from a GGUF's blocks where the kernels are
    grouped and engine.model.gguf_load builds the file (why_not_direct), else through transformers' float copy."""
    gguf = open_gguf(options.base)
    if options.kernels.grouped and gguf is not None:
        reason = why_not_direct(gguf)
        if reason is None:
            model = load_grouped(gguf, options.kernels is Kernels.INT8, options.attn)
            return _ready(model, load_tokenizer(options.base, gguf), options.kernels, gguf, options.pack)
        log.info("%s: %s", gguf.path, reason)
    model, tokenizer = load_base(options.base, dtype=options.dtype, device=options.device,
                                 attn_implementation=options.attn, quantization=options.quantization,
                                 max_memory=options.max_memory, gguf=gguf)
    return prepare_target(model, tokenizer, options.kernels, pack=options.pack, gguf=gguf)


def prepare_target(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, kernels: Kernels | str = Kernels.FLOAT,
                   *, pack: bool = False, gguf: GgufFile | None = None) -> LoadedBase:
    """A float model (loaded by transformers, or built in memory) made ready as load_target makes one: on grouped
    kernels its float32 layers become the GGUF file's own groups where they match (gguf), else quantized (which
    changes the model); with pack, its float layers packed and, wholly on the CPU, the batch-invariant attention."""
    kernels = Kernels(kernels)
    if kernels.grouped:
        quantize_linears(model, gguf, int8=kernels is Kernels.INT8)
    return _ready(model, tokenizer, kernels, gguf, pack)


def _ready(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, kernels: Kernels, gguf: GgufFile | None,
           pack: bool) -> LoadedBase:
    if pack:
        pack_linears(model)
    exact = pack and _batch_invariant_attention(model)
    return LoadedBase(model, tokenizer, kernels, gguf, pack, exact, fused=why_not_fused(model) is None)


def _batch_invariant_attention(model: PreTrainedModel) -> bool:
    """Give a model on the CPU the fixed-order attention; True where every row of a forward then comes out the same
    bits whatever the batch: greedy EAGLE is then plain decoding exactly."""
    if not use_wide_attention(model):
        return False
    if model.dtype in packable_dtypes():
        return True
    log.warning("%s linear layers cannot be packed on this CPU, so a tree forward may round differently from "
                "one-token decoding and greedy EAGLE may differ from plain decoding: use float32",
                str(model.dtype).removeprefix("torch."))
    return False
