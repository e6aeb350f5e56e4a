"""An EAGLE-3 head's layer on grouped kernels in one C++ call (engine/model/kernels eagle3_layer), for drafting.

A draft round runs the head three or four times on a few rows, where the Python between a decoder layer's ops costs
more than the ops themselves.
"""
from __future__ import annotations

import torch

from ..model.cache import GrowingLayer
from ..model.fused import PROJECTIONS
from ..model.quant import TILE, QuantLinear
from .eagle3 import Eagle3Head

MATMULS = (PROJECTIONS[:3], PROJECTIONS[3:4], PROJECTIONS[4:6], PROJECTIONS[6:])  # eagle3_layer's, stacked


class FusedEagle3:
    """An EAGLE-3 head whose layer's projections are bias-free QuantLinears of Q4_1 or Q8_0 (a head on grouped
    kernels), run as the head runs (DraftHead.forward), its layer in one kernel call that writes the head's cache in
    place."""

    def __init__(self, head: Eagle3Head):
        self.head, layer = head, head.midlayer
        self.heads, self.head_dim = layer.self_attn.heads, layer.self_attn.head_dim
        self.kv_heads = layer.self_attn.kv_heads
        self._cos = self._sin = torch.empty(0, self.head_dim)
        self.eps = float(layer.input_layernorm.eps)
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm)
        self.weights = [norm.weight for norm in norms]
        for names in MATMULS:
            codes, scales, *mins = stacked([layer.get_submodule(name) for name in names])
            self.weights += [codes, scales, mins[0] if mins else torch.empty(0)]
        self.int8 = layer.self_attn.q_proj.int8

    @classmethod
    def of(cls, head) -> FusedEagle3 | None:
        """A FusedEagle3 for `head` if eagle3_layer computes exactly what its modules compute (QuantLinears exist
        only where engine/model/kernels built); the kernel adds the raw hidden state back, as the official layer does."""
        if not isinstance(head, Eagle3Head) or head.midlayer.norm_before_residual:
            return None
        projections = [head.midlayer.get_submodule(name) for name in PROJECTIONS]
        kind = getattr(projections[0], "kind", None)
        return cls(head) if kind in ("Q4_1", "Q8_0") and stackable(projections, kind) else None

    def run(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
            layer: GrowingLayer, start: int, from_target: bool) -> torch.Tensor:
        """The head over new slots [1, T] as DraftHead.forward runs it, their keys and values written into the head's
        cache `layer` at `start` by the kernel itself; they see the positions before `start` and, as mask says
        (None: causally), each other. Returns the new hidden states [1, T, H]."""
        head = self.head
        hidden = hidden.to(head.fc.weight.dtype)
        hidden = head.fc(hidden) if from_target else hidden
        cos, sin = self._rope(positions)
        like = hidden.new_empty(1, self.kv_heads, 0, self.head_dim)
        keys, values = layer.reserve(start + hidden.shape[1], like, like)
        return torch.ops.eagle_cpu.eagle3_layer(head.embed(token_ids), hidden, cos, sin, keys, values, start, mask,
                                                self.weights, self.heads, self.head_dim, self.eps, self.int8)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Eagle3Head.logits with its final norm as one kernel call (the same bits)."""
        norm = self.head.norm
        return self.head.lm_head(torch.ops.eagle_cpu.rms_norm(hidden, norm.weight, norm.eps))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`: rows of a table the head's own rotary computes once for the positions seen so
        far (every row the bits computing it alone gives: the same elementwise ops)."""
        needed = int(positions.max()) + 1
        if needed > len(self._cos):
            self._cos, self._sin = self.head.rope(torch.arange(max(needed, 2 * len(self._cos), 256)))
        return self._cos[positions], self._sin[positions]


def stackable(modules: list, kind: str) -> bool:
    """Bias-free QuantLinears of `kind`, all int8 or none; int8 ones in whole tiles, so that stacking keeps every
    projection's features where the kernel call's output puts them."""
    if not all(isinstance(m, QuantLinear) and m.kind == kind and m.bias is None for m in modules):
        return False
    return len({m.int8 for m in modules}) == 1 and not (modules[0].int8 and any(m.out_features % TILE for m in modules))


def stacked(projections: list[QuantLinear]) -> list[torch.Tensor]:
    """The groups of projections that take the same input (codes, scales and, for Q4_1, mins), stacked by output
    feature; the projections' own buffers become views of them, so the weights are held once."""
    parts = ("codes", "scales", "mins") if projections[0].kind == "Q4_1" else ("codes", "scales")
    if len(projections) == 1:
        return [getattr(projections[0], part) for part in parts]
    merged = [torch.cat([getattr(p, part) for p in projections]) for part in parts]
    start = 0
    for projection in projections:  # by features, or by tiles of them on int8 kernels: the buffers' first dimension
        end = start + len(projection.codes)
        for part, tensor in zip(parts, merged):
            setattr(projection, part, tensor[start:end])
        start = end
    return merged
