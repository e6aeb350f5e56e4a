"""A float model's linear layers onto the grouped kernels (engine.model.quant): a GGUF base's own groups, matched to
the parameters transformers dequantized from them, or, for a model without a GGUF file, its weights quantized as
llama.cpp's converter does (Q4_1 layers, Q8_0 LM head): then its groups are the model both plain decoding and EAGLE
run. A GGUF that engine.model.gguf_load builds directly never comes here; this is the path for one it cannot
(engine.model.gguf_load.why_not_direct) and for models in memory.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PreTrainedModel

from . import kernels
from .groups import GROUP, Groups, groups_from_blocks, quantize
from .gguf_tensors import FLOAT_TYPES, GgufFile, TensorBlocks, gguf_name, tensor_names
from .quant import GroupedEmbedding, QuantLinear, float_kernel_takes

log = logging.getLogger(__name__)


def gguf_groups(model: PreTrainedModel, gguf: GgufFile) -> dict[int, Groups]:
    """The GGUF file's grouped tensors (every type engine.model.groups reads), keyed by id() of the model parameter
    transformers loaded from each (rows put in transformers' order, as it permutes Llama's q and k), kept only where
    they dequantize to exactly that parameter's float32 values."""
    return _gguf_weights(model, gguf)[0]


def _gguf_weights(model: PreTrainedModel, gguf: GgufFile) -> tuple[dict[int, Groups], set[int]]:
    """gguf_groups, and id() of the model parameters the file holds as float matrices (F16, BF16, F32)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(gguf.architecture, TensorProcessor)(config=model.config.to_dict())
    float_kinds = {name for name, _ in FLOAT_TYPES.values()}
    found, floats = {}, set()
    for weight, tensor in _file_tensors(model, gguf):
        if tensor.kind in float_kinds and len(tensor.shape) == 2:
            floats.add(id(weight))
        if not tensor.grouped:
            continue
        groups = groups_from_blocks(tensor.kind, processor.process(weights=tensor.blocks, name=tensor.name).weights)
        if weight.dtype == torch.float32 and torch.equal(groups.dequantize(), weight):
            found[id(weight)] = groups
        else:
            log.warning("%s: its GGUF groups do not give the loaded weights exactly; that layer keeps float kernels",
                        tensor.name)
    return found, floats


def _file_tensors(model: PreTrainedModel, gguf: GgufFile) -> list[tuple[torch.Tensor, TensorBlocks]]:
    """(weight, its GGUF tensor) for each linear or embedding weight of `model` the file holds, by gguf's name map
    (a tied LM head is the embedding under two names)."""
    names = tensor_names(gguf.architecture, model.config.get_text_config().num_hidden_layers)
    if names is None:
        return []
    stored = {t.name: t for t in gguf.tensors}
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    pairs = []
    for module in model.modules():
        if type(module) is not nn.Linear and not isinstance(module, nn.Embedding):
            continue
        candidates = [gguf_name(names, name) for name in aliases.get(id(module.weight), [])]
        tensor = next((stored[n] for n in candidates if n in stored), None)
        if tensor is not None:
            pairs.append((module.weight, tensor))
    return pairs


def quantize_linears(model: nn.Module, gguf: GgufFile | None = None, kind: str = "Q4_1", int8: bool = False,
                     kinds: dict[str, str] | None = None) -> int:
    """Replace the float32 CPU nn.Linear layers of `model` whose inputs come in groups of 32 by QuantLinears (int8:
    on int8 activations); returns how many. With a GGUF file, the layers its groups hold exactly, of the types the
    chosen kernels take, and on int8 kernels its float matrices rounded to Q8_0 (so that every layer is on them);
    without one, every such layer is quantized to `kind` (a PreTrainedModel's LM head to Q8_0), or to the kind
    `kinds` gives its attribute name."""
    if not kernels.available():
        raise RuntimeError(f"QuantLinear needs engine/model/kernels: {kernels.unavailable_reason()}")
    found, floats = _gguf_weights(model, gguf) if gguf is not None else (None, set())
    floats = floats if int8 else set()
    lm_head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    count = rounded = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu" or child.in_features % GROUP:
                continue
            if child.weight.dtype != torch.float32:
                continue
            if found is None:
                groups = quantize(child.weight, "Q8_0" if child is lm_head else (kinds or {}).get(name, kind))
            elif id(child.weight) in found and (int8 or float_kernel_takes(found[id(child.weight)])):
                groups = found[id(child.weight)]
            elif id(child.weight) in floats:  # F16, BF16, F32: rounded as the int8 kernels round activations
                groups = quantize(child.weight, "Q8_0")
                rounded += 1
            else:
                continue
            setattr(parent, name, QuantLinear(groups, child.bias, int8))
            count += 1
    if rounded:
        log.info("%d float matrices of the GGUF file rounded to Q8_0 groups for the int8 kernels (kernels='float' "
                 "keeps them as they are)", rounded)
    if found is not None and isinstance(model, PreTrainedModel):
        _embed_from_groups(model, found, tied=lm_head is not None and lm_head.weight is model.get_input_embeddings()
                           .weight)
        _own_float_tensors(model)
    return count


def _own_float_tensors(model: nn.Module) -> None:
    """Copy the float tensors the model still holds (norms, biases) out of the file transformers mapped them from:
    each is a view into that mapping, and one small norm kept every page of the float conversion read while loading
    resident (a gigabyte for a 270M model), long after its matrices became groups."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.dtype.is_floating_point and tensor.numel():
                tensor.data = tensor.data.clone()


def _embed_from_groups(model: PreTrainedModel, found: dict[int, Groups], tied: bool) -> None:
    """Replace the model's float input embedding by its GGUF groups where the file holds them exactly (tied: the
    LM head's, already replaced)."""
    table = model.get_input_embeddings()
    if not isinstance(table, nn.Embedding) or id(table.weight) not in found:
        return
    head = model.get_output_embeddings()
    rows = head if tied and isinstance(head, QuantLinear) else QuantLinear(found[id(table.weight)], None, int8=True)
    model.set_input_embeddings(GroupedEmbedding(rows, table))
