"""Linear layers that keep their weights as a GGUF type's groups of 32 (engine.model.groups: every type from Q4_0
to Q6_K) and multiply them with engine/model/kernels, for a CPU forward that reads a fraction of float32's bytes and
stays batch-invariant; and the embedding over the same groups.

A one-token step on the CPU is bound by the bytes of weight it reads: float32 reads 4 bytes a weight, Q4_K about
0.58. A GGUF model's groups are taken as they are in the file (the embedded SmolLM2: Q4_1 layers, a Q8_0 embedding
that is also the LM head): built straight from it (engine.model.gguf_load) or checked against the float32 weights
transformers dequantized from it. On int8 activations (the default) a layer computes as llama.cpp does (each row's
activations rounded to 8 bits per group, integer products: another rounding of the model, the fastest; `repack`
lays the groups out for it); on float32 activations the kernel multiplies by the very float32 weights, in its own
fixed order. Which layers become these: engine.model.gguf_load (from the file's blocks) and engine.model.gguf_match
(over a float model); which kernels run: engine.model.kernel_policy. Also the KV cache's dtype beside them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from .attention import FIXED_ORDER
from .groups import GROUP, Groups


TILE = 16  # output features per tile of the int8 kernels: one a vector lane


@dataclass
class Repacked:
    """Groups as the int8 kernels read them (engine/model/kernels/int8.cpp): output features in tiles of
    16, padded with zero weights; for each tile and group, chunks of 4 consecutive weights of the 16 features (codes
    [tiles, in/32, chunks, 16, 4]: 4-bit codes in 4 chunks of nibble pairs, byte k of chunk c holding weights 4c + k
    and 4c + k + 16 as GGUF's byte 4c + k does; 8-bit codes in 8 chunks), scales [tiles, in/32, (2,) 16] and mins
    [tiles, in/32, 16]: float16 where every value is one, as GGUF keeps Q4_1's and Q8_0's (a sixth of a Q4_1 layer's
    bytes fewer than float32 for kernels that read every byte a step), else float32; for a K-quant, its integer
    group scales and mins (int8) with its blocks' float16 ones [tiles, in/256, 16] (block_scales, block_mins), which
    the kernel multiplies back into the very float32 products."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    block_scales: torch.Tensor | None = None
    block_mins: torch.Tensor | None = None

    def float_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scales and mins in this layout as float32 (a K-quant's multiplied out)."""
        if self.block_scales is None:
            return self.scales.float(), None if self.mins is None else self.mins.float()
        per = self.scales.shape[1] // self.block_scales.shape[1]  # groups a block
        scales = self.scales.float() * self.block_scales.float().repeat_interleave(per, dim=1).view(
            *self.scales.shape[:2], *([1] * (self.scales.dim() - 3)), self.scales.shape[-1])
        mins = None if self.mins is None else \
            self.mins.float() * self.block_mins.float().repeat_interleave(per, dim=1)
        return scales, mins

    def groups(self, kind: str, out_features: int) -> Groups:
        """The Groups that `repack` laid out as these (its inverse, its scales and mins as float32)."""
        tiles, count, chunks = self.codes.shape[:3]
        codes = self.codes.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, count * chunks * 4)[:out_features]
        by_row = [None if t is None else _lanes_first(t).reshape(tiles * TILE, -1)[:out_features]
                  for t in self.float_scales()]
        return Groups(kind, codes.contiguous(), *by_row)


def _lanes_first(t: torch.Tensor) -> torch.Tensor:
    """Repacked scales or mins [tiles, groups, (2,) 16] as [tiles, 16, groups (, 2)]."""
    return t.permute(0, 2, 1) if t.dim() == 3 else t.permute(0, 3, 1, 2)


def repack(groups: Groups) -> Repacked:
    """`groups` in the int8 kernels' layout: the same codes and scales, moved."""
    out, count = groups.codes.shape[0], groups.in_features // GROUP
    tiles = -(-out // TILE)
    per_group = GROUP // 2 if groups.four_bit else GROUP

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(tiles * TILE - out, *t.shape[1:])])

    def by_lane(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """[out, n] (or [out, 2n]: two a group) as [tiles, n, (2,) 16]."""
        if t is None:
            return None
        return padded(t).view(tiles, TILE, t.shape[1] // (2 if t is groups.scales and groups.halves else 1), -1) \
            .permute(0, 2, 3, 1).squeeze(2).contiguous().to(dtype)

    codes = padded(groups.codes.view(out, count, per_group))
    codes = codes.view(tiles, TILE, count, per_group // 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    if groups.factors is not None:
        f = groups.factors
        halves = f.group_scales.shape[1] == 2 * count
        scales = padded(f.group_scales).view(tiles, TILE, count, 2 if halves else 1).permute(0, 2, 3, 1).squeeze(2)
        return Repacked(codes, scales.contiguous(), by_lane(f.group_mins, torch.int8),
                        by_lane(f.block_scales, torch.float16), by_lane(f.block_mins, torch.float16))
    held = [t for t in (groups.scales, groups.mins) if t is not None]
    dtype = torch.float16 if all(torch.equal(t.half().float(), t) for t in held) else torch.float32
    return Repacked(codes, by_lane(groups.scales, dtype), by_lane(groups.mins, dtype))


class QuantLinear(nn.Module):
    """Inference-only stand-in for an nn.Linear on the CPU, its weight held as Groups (float32 inputs). int8: its
    inputs are rounded to 8 bits per group of 32 and multiplied as integers (the weights held as `repack` lays
    them out), for every type Groups reads; else they multiply the dequantized weights in float32 (4-bit codes with
    a min, or 8-bit ones with neither a min nor two scales a group: Q4_0, Q4_1, Q4_K, Q5_0, Q8_0)."""

    def __init__(self, groups: Groups, bias: torch.Tensor | None, int8: bool = False):
        super().__init__()
        if not int8 and not float_kernel_takes(groups):
            raise ValueError(f"{groups.kind} groups multiply on the int8 kernels only")
        self.kind, self.int8, self.four_bit = groups.kind, int8, groups.four_bit
        self.out_features, self.in_features = groups.codes.shape[0], groups.in_features
        held = repack(groups) if int8 else groups
        self.register_buffer("codes", held.codes)
        self.register_buffer("scales", held.scales)
        self.register_buffer("mins", held.mins)
        self.register_buffer("block_scales", held.block_scales if int8 else None)
        self.register_buffer("block_mins", held.block_mins if int8 else None)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        # An empty stand-in: code that asks a layer for its weight's dtype or device keeps working.
        self.register_buffer("weight", torch.empty(0), persistent=False)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the groups stand for (for code that needs the rows themselves, as a head's
        training target does)."""
        return self.groups().dequantize()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weights of output features `ids` [..] as [.., in_features], the floats dequantize gives (an
        embedding's lookup, when this is its table): on the int8 layout one kernel call, no Python per group."""
        if self.int8:
            return torch.ops.eagle_cpu.int8_rows(ids, self.codes, self.scales, self.mins, self.block_scales,
                                                 self.block_mins, self.out_features)
        flat = ids.reshape(-1)
        groups = Groups(self.kind, self.codes[flat], self.scales[flat], None if self.mins is None else self.mins[flat])
        return groups.dequantize().view(*ids.shape, self.in_features)

    def groups(self) -> Groups:
        if self.int8:
            return Repacked(self.codes, self.scales, self.mins, self.block_scales, self.block_mins).groups(
                self.kind, self.out_features)
        return Groups(self.kind, self.codes, self.scales, self.mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.eagle_cpu
        if self.int8:
            return ops.int8_linear(x, self.codes, self.scales, self.mins, self.block_scales, self.block_mins,
                                   self.bias, self.out_features)
        if self.four_bit:
            return ops.q4_1_linear(x, self.codes, self.scales, self.mins, self.bias)
        return ops.q8_0_linear(x, self.codes, self.scales, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"
                f"{', int8 activations' if self.int8 else ''}")


def float_kernel_takes(groups: Groups) -> bool:
    """Whether the float32-activation kernels (linear.cpp) multiply `groups`: 4-bit codes with a min per group, or
    8-bit codes with one scale a group and no min."""
    return (groups.mins is not None) if groups.four_bit else (groups.mins is None and not groups.halves)


class GroupedEmbedding(nn.Module):
    """A GGUF base's input embedding read from its groups (the LM head's own where the two are tied): the rows of
    the tokens looked up, dequantized as they are needed, the very floats the float table held (times the scale a
    model such as Gemma puts on its embeddings), so no float copy of the table stays resident: a 262k-token
    vocabulary's is 0.7 GB."""

    def __init__(self, table: QuantLinear, replacing: nn.Embedding):
        """table: the groups; replacing: the float embedding module it stands for (its scale, if it has one)."""
        super().__init__()
        self._table = (table,)  # not a submodule: a tied table is the LM head's, which the model holds already
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        scale = getattr(replacing, "embed_scale", None)
        self.register_buffer("scale", None if scale is None else scale.detach().to(torch.float32).clone(),
                             persistent=False)
        self.register_buffer("weight", torch.empty(0), persistent=False)  # its dtype, for code that asks

    @property
    def table(self) -> QuantLinear:
        return self._table[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(ids)
        return rows if self.scale is None else rows * self.scale


def kv_dtype(model: PreTrainedModel) -> torch.dtype | None:
    """The dtype of `model`'s KV cache: float16 for a model on the grouped kernels under the fixed-order attention (a
    GGUF base, kept as llama.cpp keeps it: over a long context reading the cache is most of a step's memory traffic);
    None, the model's own dtype, for any other (a float32 model then decodes as transformers decodes it)."""
    grouped = any(isinstance(module, QuantLinear) for module in model.get_decoder().modules())
    return torch.float16 if grouped and model.config._attn_implementation == FIXED_ORDER else None
