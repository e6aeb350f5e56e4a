"""An EAGLE-3 head's layer on Q8_0 kernels in one C++ call (engine/model/kernels eagle3_layer), for drafting.

A draft round runs the head three or four times on a few rows, where the Python between a decoder layer's ops costs
more than the ops themselves.
"""
from __future__ import annotations

import torch

from ..model.fused import MATMULS, PROJECTIONS, stackable, stacked
from .eagle3 import Eagle3Head
from .layers import KV


class FusedEagle3:
    """An EAGLE-3 head whose layer's projections are bias-free Q8_0 QuantLinears (a head on a q4 engine), called as
    the head is (DraftHead.forward), its layer in one kernel call."""

    def __init__(self, head: Eagle3Head):
        self.head, layer = head, head.midlayer
        self.heads, self.head_dim = layer.self_attn.heads, layer.self_attn.head_dim
        self.eps = float(layer.input_layernorm.eps)
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm)
        self.weights = [norm.weight for norm in norms]
        for names in MATMULS:
            self.weights += stacked([layer.get_submodule(name) for name in names])
        self.int8 = layer.self_attn.q_proj.int8

    @classmethod
    def of(cls, head) -> FusedEagle3 | None:
        """A FusedEagle3 for `head` if eagle3_layer computes exactly what its modules compute (QuantLinears exist
        only where engine/model/kernels built); the kernel adds the raw hidden state back, as the official layer does."""
        if not isinstance(head, Eagle3Head) or head.midlayer.norm_before_residual:
            return None
        projections = [head.midlayer.get_submodule(name) for name in PROJECTIONS]
        return cls(head) if stackable(projections, "Q8_0") else None

    def __call__(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, past: list[KV] | None,
                 mask: torch.Tensor, from_target: bool) -> tuple[torch.Tensor, list[KV]]:
        head = self.head
        hidden = hidden.to(head.fc.weight.dtype)
        hidden = head.fc(hidden) if from_target else hidden
        cos, sin = head.rope(positions)
        keys, values = past[0] if past is not None else (None, None)
        out, k, v = torch.ops.eagle_cpu.eagle3_layer(head.embed(token_ids), hidden, cos, sin, keys, values, mask,
                                                     self.weights, self.heads, self.head_dim, self.eps, self.int8)
        return out, [(k, v)]
