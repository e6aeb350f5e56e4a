"""An EAGLE-3 head on grouped kernels in one C++ call (engine/model/kernels eagle3_head), for drafting.

A draft round runs the head on a few rows, right after a base forward has pushed the caches' contents out: each
torch op and line of Python between the head's ops then costs tens of microseconds, more than the ops themselves.
One call runs fc, the token embeddings, the rotary rows, the decoder layer and, for the last row, the final norm and
the LM head.
"""
from __future__ import annotations

import torch

from ..model.cache import GrowingLayer
from ..model.fused import PROJECTIONS, layer_tensors, linear_tensors, on_groups
from ..model.quant import GroupedEmbedding, QuantLinear
from .eagle3 import Eagle3Head

KINDS = ("Q4_1", "Q8_0")  # the types of the head's linear layers the call takes


class FusedEagle3:
    """An EAGLE-3 head whose layer's projections are QuantLinears of Q4_1 or Q8_0 and fc and LM head bias-free ones (a
    head on grouped kernels), run as the head runs (DraftHead.forward, then Eagle3Head.logits for the last row) in one
    kernel call that writes the head's cache in place."""

    def __init__(self, head: Eagle3Head):
        self.head, layer = head, head.midlayer
        self.heads, self.head_dim = layer.self_attn.heads, layer.self_attn.head_dim
        self.kv_heads = layer.self_attn.kv_heads
        self._cos = self._sin = torch.empty(0, self.head_dim)
        self.eps = float(layer.input_layernorm.eps)
        # decoder_forward's norm slots: the input norm (here the token embeddings'), none after attention, the
        # post-attention norm before the MLP, none after it, no q or k norms
        self.layer = layer_tensors([layer.input_layernorm.weight, None, layer.post_attention_layernorm.weight,
                                    None, None, None], layer)
        self.hidden_norm = layer.hidden_norm.weight
        self.int8 = layer.self_attn.q_proj.int8
        self.fc = linear_tensors(head.fc)
        self.lm_head = [head.norm.weight, *linear_tensors(head.lm_head)]
        table = head.embedding()
        self.table, self.vocab = embedding_tensors(table), getattr(table, "num_embeddings", 0)

    @classmethod
    def of(cls, head) -> FusedEagle3 | None:
        """A FusedEagle3 for `head` if eagle3_head computes exactly what its modules compute (QuantLinears exist
        only where engine/model/kernels built); the kernel adds the raw hidden state back, as the official layer does."""
        if not isinstance(head, Eagle3Head) or head.midlayer.norm_before_residual:
            return None
        projections = [head.midlayer.get_submodule(name) for name in PROJECTIONS]
        if not on_groups([head.midlayer]) or any(p.kind not in KINDS for p in projections):
            return None
        if head.norm.eps != head.midlayer.input_layernorm.eps:
            return None
        ends = (head.fc, head.lm_head)  # each a bias-free QuantLinear on the layer's kernels
        return cls(head) if all(isinstance(end, QuantLinear) and end.kind in KINDS and end.bias is None and
                                end.int8 == projections[0].int8 for end in ends) else None

    def run(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
            layer: GrowingLayer, start: int, from_target: bool, logits: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head over new slots [1, T] as DraftHead.forward runs it, their keys and values written into the head's
        cache `layer` at `start` by the kernel itself; they see the positions before `start` and, as mask says
        (None: causally), each other; positions are at most start + T - 1. Returns the new hidden states [1, T, H]
        and, with `logits`, the last one's draft logits (Eagle3Head.logits), else None."""
        rows = hidden.shape[1]
        self._cover(start + rows)
        like = self._cos.new_empty(1, self.kv_heads, 0, self.head_dim)
        keys, values = layer.reserve(start + rows, like, like)
        embedding = self.table or [self.head.embed(token_ids)]
        out, last = torch.ops.eagle_cpu.eagle3_head(
            hidden.float(), token_ids, positions, self._cos, self._sin, keys, values, start, mask, self.layer,
            self.hidden_norm, self.fc if from_target else [], embedding, self.lm_head if logits else [], self.vocab,
            self.head.lm_head.out_features, self.heads, self.head_dim, self.eps, self.int8)
        return out, last if logits else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Eagle3Head.logits with its final norm as one kernel call (the same bits)."""
        norm = self.head.norm
        return self.head.lm_head(torch.ops.eagle_cpu.rms_norm(hidden, norm.weight, norm.eps))

    def _cover(self, positions: int) -> None:
        """Rotary tables with at least `positions` rows, computed by the head's own rotary once for the positions
        seen so far (every row the bits computing it alone gives: the same elementwise ops)."""
        if positions > len(self._cos):
            self._cos, self._sin = self.head.rope(torch.arange(max(positions, 2 * len(self._cos), 256)))


def embedding_tensors(table: torch.nn.Module) -> list[torch.Tensor]:
    """The base's embedding as eagle3_head reads it itself: an int8 GroupedEmbedding's groups and scale; [] for any
    other table (the head then looks its rows up before the call)."""
    if not isinstance(table, GroupedEmbedding) or not table.table.int8:
        return []
    scale = torch.empty(0) if table.scale is None else table.scale
    return [*linear_tensors(table.table), scale]
