"""An EAGLE-3 head on grouped kernels in one C++ call (engine/model/kernels' torch.classes.eagle_cpu.Eagle3Head, built
once from the head's dimensions and its weights by name), for drafting.

A draft round runs the head on a few rows, right after a base forward has pushed the caches' contents out: each
torch op and line of Python between the head's ops then costs tens of microseconds, more than the ops themselves.
One call runs fc, the token embeddings, the rotary rows, the decoder layer and, for the last row, the final norm and
the LM head.
"""
from __future__ import annotations

import torch

from ..model.cache import GrowingLayer
from ..model.fused import PROJECTIONS, group_weights, on_groups, projection_weights
from ..model.quant import GroupedEmbedding, QuantLinear
from .eagle3 import Eagle3Head

KINDS = ("Q4_1", "Q8_0")  # the types of the head's linear layers the call takes


class FusedEagle3:
    """An EAGLE-3 head whose layer's projections are QuantLinears of Q4_1 or Q8_0 and fc and LM head bias-free ones (a
    head on grouped kernels), run as the head runs (DraftHead.forward, then Eagle3Head.logits for the last row) in one
    kernel call that writes the head's cache in place."""

    def __init__(self, head: Eagle3Head):
        self.head, layer = head, head.midlayer
        attention = layer.self_attn
        self.kv_heads, self.head_dim = attention.kv_heads, attention.head_dim
        self.int8 = attention.q_proj.int8
        self._covered = 0  # positions the rotary tables hold
        table = head.embedding()
        self.table = embedding_weights(table)
        dimensions = {"hidden": head.config.hidden_size, "heads": attention.heads, "kv_heads": self.kv_heads,
                      "head_dim": self.head_dim, "intermediate": head.config.intermediate_size,
                      "features": head.config.feature_size, "vocab": table.num_embeddings if self.table else 0,
                      "draft_vocab": head.config.draft_vocab}
        # the input norm normalises the token embeddings here, the post-attention norm the MLP's input
        weights = {"input_norm": layer.input_layernorm.weight, "pre_mlp_norm": layer.post_attention_layernorm.weight,
                   "hidden_norm": layer.hidden_norm.weight, "final_norm": head.norm.weight,
                   **projection_weights(layer), **group_weights("fc", head.fc), **group_weights("lm_head", head.lm_head),
                   **self.table}
        self.native = torch.classes.eagle_cpu.Eagle3Head(dimensions, float(layer.input_layernorm.eps),
                                                         self.int8, weights)

    @classmethod
    def of(cls, head) -> FusedEagle3 | None:
        """A FusedEagle3 for `head` if the Eagle3Head computes exactly what its modules compute (QuantLinears exist
        only where engine/model/kernels built); the kernel adds the raw hidden state back, as the official layer does."""
        if not isinstance(head, Eagle3Head) or head.midlayer.norm_before_residual:
            return None
        projections = [head.midlayer.get_submodule(path) for path in PROJECTIONS.values()]
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
        like = torch.empty(1, self.kv_heads, 0, self.head_dim)
        keys, values = layer.reserve(start + rows, like, like)
        tokens = (token_ids, None if self.table else self.head.embed(token_ids))
        out, last = self.native.forward(hidden.float(), tokens, positions, mask, (keys, values, start), from_target,
                                        logits)
        return out, last

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Eagle3Head.logits with its final norm as one kernel call (the same bits)."""
        norm = self.head.norm
        return self.head.lm_head(torch.ops.eagle_cpu.rms_norm(hidden, norm.weight, norm.eps))

    def _cover(self, positions: int) -> None:
        """Rotary tables with at least `positions` rows, computed by the head's own rotary once for the positions
        seen so far (every row the bits computing it alone gives: the same elementwise ops)."""
        if positions > self._covered:
            self._covered = max(positions, 2 * self._covered, 256)
            self.native.set_rotary(*self.head.rope(torch.arange(self._covered)))


def embedding_weights(table: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base's embedding as the Eagle3Head reads it itself: an int8 GroupedEmbedding's groups and scale; none for
    any other table (the head then looks its rows up before the call)."""
    if not isinstance(table, GroupedEmbedding) or not table.table.int8:
        return {}
    scale = {} if table.scale is None else {"embedding.scale": table.scale}
    return group_weights("embedding", table.table) | scale
