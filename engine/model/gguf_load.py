"""A GGUF base built straight onto the grouped kernels: each matrix becomes a QuantLinear from the file's own blocks,
the embedding a GroupedEmbedding over them, and only the small float tensors (norms, biases) are read as floats.

transformers loads a GGUF by dequantizing every tensor to float32: 8x a Q4 file's size in memory and most of a load's
time (a 1B model: 4.4 GB and half a minute), only for the grouped kernels to throw the floats away again; an 8B
file would not fit a 24 GB machine at all. Here the model's modules are made without weights (accelerate's
init_empty_weights), from the configuration and tokenizer gguf_cache keeps, and filled from the memory-mapped file.
The groups are the numbers transformers would have dequantized (engine.model.groups reads each type as gguf-py
does, tests/test_gguf_types.py), its tensor processors put the rows in transformers' order (Llama's q and k) and
Gemma's norms in its convention, so the model is the one transformers' loading and quantize_linears give.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from . import gguf_cache
from ..progress import progress_bar
from .gguf_tensors import GgufFile, TensorBlocks, gguf_name, tensor_names
from .groups import groups_from_blocks, quantize
from .quant import GroupedEmbedding, QuantLinear, float_kernel_takes

log = logging.getLogger(__name__)
# The GGUF architectures whose tensors map one to one onto transformers' modules (engine.model.fused's families).
DIRECT = ("llama", "qwen2", "qwen3", "gemma3")


def why_not_direct(gguf: GgufFile) -> str | None:
    """Why load_grouped cannot build this file's model onto the grouped kernels, in words; None where it can (the
    fast exact path: the fused decoder then runs it). Else transformers' loading and engine.model.gguf_match do,
    and what the kernels do not read runs dequantized to float32."""
    reasons = []
    if gguf.architecture not in DIRECT:
        reasons.append(f"architecture {gguf.architecture or '(none stated)'} is not one of {', '.join(DIRECT)}: it "
                       "runs through transformers' layers")
    unread = Counter(tensor.kind for tensor in gguf.tensors if tensor.blocks is None)
    if unread:
        reasons.append(", ".join(f"{count} {kind}" for kind, count in unread.items())
                       + " tensors, which the int8 kernels do not read: those layers run on transformers' float32 "
                       "dequantization")
    return "; ".join(reasons) or None


def load_grouped(gguf: GgufFile, int8: bool, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """The model of `gguf` with every matrix on the grouped kernels (int8: on int8 activations; a float matrix, or
    one of a type the float-activation kernels do not take, rounded to Q8_0 there, kept as floats for them)."""
    from accelerate import init_empty_weights

    path = gguf.path
    folder = gguf_cache.converted(path, weights=False)
    config = AutoConfig.from_pretrained(str(folder) if folder else str(path.parent),
                                        **({} if folder else {"gguf_file": path.name}))
    with init_empty_weights(include_buffers=False):  # rotary tables and scales are made, weights are not
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    _Filler(model, gguf, int8).fill()
    model.name_or_path = config.name_or_path = str(path)
    return model.eval().requires_grad_(False)


class _Filler:
    """Puts the file's tensors into the model's empty modules, by the names gguf's tensor map gives them."""

    def __init__(self, model: PreTrainedModel, gguf: GgufFile, int8: bool):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.model, self.gguf, self.int8 = model, gguf.path, int8
        self.stored = {t.name: t for t in gguf.tensors}
        self.names = tensor_names(gguf.architecture, model.config.get_text_config().num_hidden_layers)
        self.processor = TENSOR_PROCESSORS.get(gguf.architecture, TensorProcessor)(config=model.config.to_dict())

    def fill(self) -> None:
        log.info("building the model from %s's blocks", self.gguf)
        head = self.model.get_output_embeddings()
        table = self.model.get_input_embeddings()
        embedding = self.stored.get(self._gguf_name(f"{self._name_of(table)}.weight") or "")
        linears = [(parent, name, child) for parent in self.model.modules() for name, child in parent.named_children()
                   if type(child) is nn.Linear]
        for parent, name, child in progress_bar(iterable=linears, desc="building the model", unit="matrix", leave=False):
            setattr(parent, name, self._linear(child, embedding if child is head else None))
        head = self.model.get_output_embeddings()
        self.model.set_input_embeddings(self._embedding(table, embedding, head))
        for name, parameter in list(self.model.named_parameters()):
            if parameter.is_meta:
                self._set(name, torch.from_numpy(self._floats(self._stored(name))))

    def _name_of(self, module: nn.Module) -> str:
        return next(name for name, candidate in self.model.named_modules(remove_duplicate=False) if candidate is module)

    def _gguf_name(self, parameter: str) -> str | None:
        return gguf_name(self.names, parameter)

    def _stored(self, parameter: str) -> TensorBlocks:
        tensor = self.stored.get(self._gguf_name(parameter) or "")
        if tensor is None:
            raise ValueError(f"{self.gguf} has no tensor for {parameter} ({self._gguf_name(parameter)})")
        if tensor.blocks is None:
            raise ValueError(f"{self.gguf}: {tensor.name} is {tensor.kind}, a type the engine does not read")
        return tensor

    def _processed(self, tensor: TensorBlocks, values):
        """Rows in transformers' order and values in its convention, as its loader makes them."""
        return self.processor.process(weights=values, name=tensor.name).weights

    def _floats(self, tensor: TensorBlocks):
        if tensor.grouped:
            return self._processed(tensor, groups_from_blocks(tensor.kind, tensor.blocks).dequantize().numpy())
        return self._processed(tensor, tensor.floats()).copy()

    def _linear(self, linear: nn.Linear, tied: TensorBlocks | None) -> nn.Module:
        """A QuantLinear of the file's groups for `linear` (an LM head the file ties to the embedding reads the
        embedding's), or Q8_0 groups of a float matrix on int8 kernels, or float weights."""
        name = self._name_of(linear)
        tensor = self.stored.get(self._gguf_name(f"{name}.weight") or "") or tied
        if tensor is None:
            raise ValueError(f"{self.gguf} has no tensor for {name}.weight")
        bias = None if linear.bias is None else torch.from_numpy(self._floats(self._stored(f"{name}.bias")))
        if tensor.grouped:
            groups = groups_from_blocks(tensor.kind, self._processed(tensor, tensor.blocks))
            if self.int8 or float_kernel_takes(groups):
                return QuantLinear(groups, bias, self.int8)
        weight = torch.from_numpy(self._floats(tensor))
        if self.int8:
            return QuantLinear(quantize(weight, "Q8_0"), bias, True)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias, requires_grad=False)
        return linear

    def _embedding(self, table: nn.Embedding, tensor: TensorBlocks | None, head: nn.Module) -> nn.Module:
        """The input embedding over the file's groups (the LM head's own where the head reads the same tensor), or
        a float table for a float tensor."""
        if tensor is None:
            raise ValueError(f"{self.gguf} has no token embedding (token_embd.weight)")
        if tensor.grouped:
            tied = self.stored.get("output.weight") is None and isinstance(head, QuantLinear)
            rows = head if tied else QuantLinear(groups_from_blocks(tensor.kind, tensor.blocks), None, int8=True)
            return GroupedEmbedding(rows, table)
        table.weight = nn.Parameter(torch.from_numpy(self._floats(tensor)), requires_grad=False)
        return table

    def _set(self, name: str, value: torch.Tensor) -> None:
        module, _, attribute = name.rpartition(".")
        setattr(self.model.get_submodule(module), attribute, nn.Parameter(value, requires_grad=False))
