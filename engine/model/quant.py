"""Linear layers that keep their weights as groups of 32 (4-bit Q4_1, 8-bit Q8_0) and multiply them with
engine/model/kernels, for a CPU forward that reads a fraction of float32's bytes and stays batch-invariant.

A one-token step on the CPU is bound by the bytes of weight it reads: float32 reads 4 bytes a weight, Q4_1 0.625 and
Q8_0 1.06. A GGUF model's groups are taken as they are in the file (the embedded SmolLM2: Q4_1 layers, a Q8_0
embedding that is also the LM head) and checked against the float32 weights transformers dequantized from it: the
kernel multiplies by the very same float32 weights, in its own fixed order; or, on int8 activations, computes as
llama.cpp does (each row's activations rounded to 8 bits per group, integer products: another rounding of the
model, about twice as fast; `repack` lays the groups out for it). A model without a GGUF file is quantized
here, as llama.cpp's converter does (Q4_1 layers, Q8_0 LM head): then its groups are the model both plain decoding
and EAGLE run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from . import kernels
from .attention import FIXED_ORDER
from .gguf_tensors import BLOCK_BYTES, read_tensors
from .load import _source, on_gpu

GROUP = 32
KERNELS = ("auto", "float", "q4", "int8")
GROUPED = ("q4", "int8")  # the kernels that keep a GGUF's groups (engine/model/kernels)
KERNELS_HELP = ("the CPU linear layers: float = oneDNN-packed float weights; q4 = a GGUF's 4-bit groups as they are, "
                "times float32 activations; int8 = the same groups times activations rounded to 8 bits per group of "
                "32, integer products as llama.cpp computes them (another rounding of the model, the fastest; "
                "docs/models.md); auto = int8 for a GGUF base on the CPU in float32 or dtype auto, else float")
log = logging.getLogger(__name__)


@dataclass
class Groups:
    """One weight [out, in] as groups of 32 along `in`: Q4_1 w = scale * q + min (q 0..15, uint8 codes [out, in/2],
    byte j of a group holding element j low and element j + 16 high, as GGUF stores them); Q8_0 w = scale * q (int8
    codes [out, in]). Scales and mins are float32 [out, in/32] (exact copies of GGUF's float16 ones)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these groups stand for, rounded as gguf's dequantize rounds them."""
        out = self.codes.shape[0]
        if self.kind == "Q8_0":
            return (self.codes.view(out, -1, GROUP).float() * self.scales[..., None]).view(out, -1)
        packed = self.codes.view(out, -1, GROUP // 2)
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()
        return (self.scales[..., None] * q + self.mins[..., None]).view(out, -1)


TILE = 16  # output features per tile of the int8 kernels: one a vector lane


@dataclass
class Repacked:
    """Groups as the int8 kernels read them (engine/model/kernels/int8.cpp): output features in tiles of
    16, padded with zero weights; for each tile and group, chunks of 4 consecutive weights of the 16 features (codes
    [tiles, in/32, chunks, 16, 4]: Q4_1 4 chunks of nibble pairs, byte k of chunk c holding weights 4c + k and
    4c + k + 16 as GGUF's byte 4c + k does; Q8_0 8 chunks of int8), scales and mins [tiles, in/32, 16] in float16,
    as GGUF keeps them (a sixth of a Q4_1 layer's bytes fewer than float32 for kernels that read every byte a step)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def groups(self, kind: str, out_features: int) -> Groups:
        """The Groups that `repack` laid out as these (its inverse)."""
        tiles, count, chunks = self.codes.shape[:3]
        codes = self.codes.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, count * chunks * 4)[:out_features]
        by_row = [None if t is None else t.transpose(1, 2).reshape(tiles * TILE, count)[:out_features].float()
                  for t in (self.scales, self.mins)]
        return Groups(kind, codes.contiguous(), *by_row)


def repack(groups: Groups) -> Repacked:
    """`groups` in the int8 kernels' layout: the same bytes and scales, moved."""
    out, count = groups.scales.shape
    tiles = -(-out // TILE)
    per_group = GROUP // 2 if groups.kind == "Q4_1" else GROUP
    codes = groups.codes.view(out, count, per_group)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(tiles * TILE - out, *t.shape[1:])])

    def half(t: torch.Tensor) -> torch.Tensor:
        if not torch.equal(t.half().float(), t):
            raise ValueError("the int8 kernels keep group scales and mins as float16: these are not float16 values")
        return t.half()

    codes = padded(codes).view(tiles, TILE, count, per_group // 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    by_lane = [None if t is None else half(padded(t).view(tiles, TILE, count).transpose(1, 2).contiguous())
               for t in (groups.scales, groups.mins)]
    return Repacked(codes, *by_lane)


def groups_from_blocks(kind: str, blocks: np.ndarray) -> Groups:
    """GGUF blocks [out, in/32 * block bytes] (uint8) as Groups."""
    raw = torch.from_numpy(np.array(blocks)).view(blocks.shape[0], -1, BLOCK_BYTES[kind])  # a copy, off the file
    halves = raw[..., : 4 if kind == "Q4_1" else 2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        codes = raw[..., 2:].contiguous().view(torch.int8).view(raw.shape[0], -1)
        return Groups(kind, codes, halves[..., 0].contiguous())
    codes = raw[..., 4:].contiguous().view(raw.shape[0], -1)
    return Groups(kind, codes, halves[..., 0].contiguous(), halves[..., 1].contiguous())


def quantize(weight: torch.Tensor, kind: str) -> Groups:
    """Round a float weight to groups as llama.cpp's reference quantizer (and gguf-py) does: Q4_1 spans each
    group's min..max in 15 steps, Q8_0 scales its largest magnitude to 127; scales and mins are stored as float16."""
    out = weight.shape[0]
    w = weight.detach().float().view(out, -1, GROUP)
    if kind == "Q8_0":
        scales = w.abs().amax(-1, keepdim=True) / 127
        scaled = w * torch.where(scales == 0, 0, 1 / scales)
        whole = scaled.abs().floor()
        q = scaled.sign() * (whole + (2 * (scaled.abs() - whole)).floor())  # halves away from zero
        return Groups(kind, q.to(torch.int8).view(out, -1), scales[..., 0].half().float())
    low = w.amin(-1, keepdim=True)
    scales = (w.amax(-1, keepdim=True) - low) / 15
    q = ((w - low) * torch.where(scales == 0, 0, 1 / scales) + 0.5).trunc().clamp(0, 15).to(torch.uint8)
    codes = (q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)).view(out, -1)
    return Groups(kind, codes, scales[..., 0].half().float(), low[..., 0].half().float())


class QuantLinear(nn.Module):
    """Inference-only stand-in for an nn.Linear on the CPU, its weight held as Groups (float32 inputs). int8: its
    inputs are rounded to 8 bits per group of 32 and multiplied as integers (the weights held as `repack` lays
    them out), else they multiply the dequantized weights in float32."""

    def __init__(self, groups: Groups, bias: torch.Tensor | None, int8: bool = False):
        super().__init__()
        self.kind, self.int8 = groups.kind, int8
        self.out_features, self.in_features = groups.scales.shape[0], groups.scales.shape[1] * GROUP
        held = repack(groups) if int8 else groups
        self.register_buffer("codes", held.codes)
        self.register_buffer("scales", held.scales)
        self.register_buffer("mins", held.mins)
        self.bias = None if bias is None else bias.detach().float()
        # An empty stand-in: code that asks a layer for its weight's dtype or device keeps working.
        self.register_buffer("weight", torch.empty(0), persistent=False)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the groups stand for (for code that needs the rows themselves, as a head's
        training target does)."""
        if self.int8:
            return Repacked(self.codes, self.scales, self.mins).groups(self.kind, self.out_features).dequantize()
        return Groups(self.kind, self.codes, self.scales, self.mins).dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.eagle_cpu
        if self.int8 and self.kind == "Q4_1":
            return ops.q4_1_int8_linear(x, self.codes, self.scales, self.mins, self.bias, self.out_features)
        if self.int8:
            return ops.q8_0_int8_linear(x, self.codes, self.scales, self.bias, self.out_features)
        if self.kind == "Q4_1":
            return ops.q4_1_linear(x, self.codes, self.scales, self.mins, self.bias)
        return ops.q8_0_linear(x, self.codes, self.scales, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"
                f"{', int8 activations' if self.int8 else ''}")


def gguf_file(base: str | None) -> Path | None:
    """The GGUF file that engine.model.load loads `base` from (None for other checkpoints, or a hub GGUF not in the
    local cache): the file whose groups the kernels keep, and the one llama.cpp runs."""
    name, options = _source(base)
    if "gguf_file" not in options:
        return None
    if Path(name).is_dir():
        return Path(name) / options["gguf_file"]
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, options["gguf_file"], revision=options.get("revision"))
    return Path(cached) if isinstance(cached, str) else None


def gguf_groups(model: PreTrainedModel, path: Path) -> dict[int, Groups]:
    """The GGUF file's Q4_1 and Q8_0 tensors, keyed by id() of the model parameter transformers loaded from each
    (rows put in transformers' order, as it permutes Llama's q and k), kept only where they dequantize to exactly
    that parameter's float32 values."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map  # transformers' GGUF loading needs gguf too
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    architecture, tensors = read_tensors(path)
    stored = {t.name: t for t in tensors if t.blocks is not None}
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        return {}
    name_map = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    aliases: dict[int, list[str]] = {}  # a tied LM head is the embedding under two names
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    found = {}
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        candidates = [_gguf_name(name_map, name) for name in aliases.get(id(module.weight), [])]
        tensor = next((stored[n] for n in candidates if n in stored), None)
        if tensor is None:
            continue
        blocks = processor.process(weights=tensor.blocks, name=tensor.name).weights
        groups = groups_from_blocks(tensor.kind, blocks)
        if module.weight.dtype == torch.float32 and torch.equal(groups.dequantize(), module.weight):
            found[id(module.weight)] = groups
        else:
            log.warning("%s: its GGUF groups do not give the loaded weights exactly; that layer keeps float kernels",
                        tensor.name)
    return found


def _gguf_name(name_map, parameter: str) -> str | None:
    module, _, kind = parameter.rpartition(".")
    base = name_map.get_name(module)
    return None if base is None else f"{base}.{kind}"


def quantize_linears(model: nn.Module, gguf_file: Path | None = None, kind: str = "Q4_1", int8: bool = False) -> int:
    """Replace the float32 CPU nn.Linear layers of `model` whose inputs come in groups of 32 by QuantLinears (int8:
    on int8 activations); returns how many. With a GGUF file, the layers its Q4_1/Q8_0 groups hold exactly (others
    keep float weights); without one, every such layer is quantized to `kind` (a PreTrainedModel's LM head to
    Q8_0)."""
    if not kernels.available():
        raise RuntimeError(f"QuantLinear needs engine/model/kernels: {kernels.unavailable_reason()}")
    found = gguf_groups(model, gguf_file) if gguf_file is not None else None
    lm_head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu" or child.in_features % GROUP:
                continue
            if child.weight.dtype != torch.float32:
                continue
            if found is None:
                groups = quantize(child.weight, "Q8_0" if child is lm_head else kind)
            elif id(child.weight) in found:
                groups = found[id(child.weight)]
            else:
                continue
            setattr(parent, name, QuantLinear(groups, child.bias, int8))
            count += 1
    return count


def resolve_kernels(kernels: str, device: str, dtype: str, pack: bool, quantization: str, gguf: Path | None) -> str:
    """Engine.load's kernels=: "float" (oneDNN-packed float layers, engine.model.packed), "q4" (QuantLinear layers: a
    GGUF base's own groups; another base quantized to Q4_1 with its LM head in Q8_0, which changes the model),
    "int8" (the same groups on int8 activations, as llama.cpp computes: another rounding again), or "auto": int8
    for a GGUF base on the CPU (dtype auto or float32) where the kernels build, the fastest (docs/benchmarks.md,
    "CPU kernels"), also where the CPU multiplies bf16 natively; float elsewhere (another base would be changed by
    quantizing it)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
    if kernels == "auto":
        return "int8" if gguf is not None and not _grouped_unusable(device, dtype, pack, quantization) else "float"
    reason = _grouped_unusable(device, dtype, pack, quantization) if kernels in GROUPED else None
    if reason:
        raise ValueError(f"kernels={kernels!r} cannot run here: {reason}")
    return kernels


def _grouped_unusable(device: str, dtype: str, pack: bool, quantization: str) -> str | None:
    if not pack:
        return "pack=False keeps transformers' own layers"
    if on_gpu(device):
        return "the grouped kernels run on the CPU"
    if quantization != "none":
        return f"quantization={quantization!r} already quantizes the layers (bitsandbytes)"
    if dtype not in ("auto", "float32"):
        return f"the grouped kernels take float32 activations, not {dtype}"
    return kernels.unavailable_reason()


def kv_dtype(model: PreTrainedModel) -> torch.dtype | None:
    """The dtype of `model`'s KV cache: float16 for a model on the grouped kernels under the fixed-order attention (a
    GGUF base, kept as llama.cpp keeps it: over a long context reading the cache is most of a step's memory traffic);
    None, the model's own dtype, for any other (a float32 model then decodes as transformers decodes it)."""
    grouped = any(isinstance(module, QuantLinear) for module in model.get_decoder().modules())
    return torch.float16 if grouped and model.config._attn_implementation == FIXED_ORDER else None
