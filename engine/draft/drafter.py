"""The draft side of a generation: the head's own KV cache over committed slots, and tree growth on top of it."""
from __future__ import annotations

import torch

from ..fused import FusedEagle3
from ..tree import DraftTree, TreeSpec
from .head import DraftHead
from .layers import KV


def _concat(first: list[KV] | None, second: list[KV] | None) -> list[KV] | None:
    """Per-layer concatenation of two key/value lists along the sequence axis (either may be None)."""
    if first is None or second is None:
        return second if first is None else first
    return [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(first, second)]


class Drafter:
    """Keeps the head's KV cache for committed slots only; tree nodes' keys live for one proposal and are dropped.

    Slot p pairs the base feature after token p with token p+1, so each round commits the features of the
    accepted path together with the tokens that follow them (the accepted drafts, then the bonus token).
    """

    def __init__(self, head: DraftHead):
        self.head = head
        self.run_head = FusedEagle3.of(head) or head  # the same bits either way, the first without Python per op
        self.device = head.fc.weight.device
        self.cache: list[KV] | None = None
        self._tree_kv: list[KV] | None = None
        self._last_hidden: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache[0][0].shape[2]

    def reset(self) -> None:
        self.cache = None

    @torch.inference_mode()
    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Append slots (features[i], next_tokens[i]); keep the head's output at the last one for the next tree."""
        t, n = len(next_tokens), self.length
        positions = torch.arange(n, n + t, device=self.device)
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([torch.ones(t, n, dtype=torch.bool, device=self.device), causal], dim=1)
        out, new_kv = self.run_head(
            features[None].to(self.device), next_tokens[None].to(self.device, non_blocking=True), positions, self.cache,
            mask[None, None],
            from_target=True,
        )
        self.cache = _concat(self.cache, new_kv)
        self._last_hidden = out[0, -1]

    @torch.inference_mode()
    def propose(self, root: int, tree: TreeSpec) -> DraftTree:
        """Grow the tree `tree` specifies under `root`, from the head's output at the last committed slot."""
        self._tree_kv = None
        return tree.grow(self, root, self._last_hidden)

    # Expander protocol, used by engine/tree.py
    def expand(self, hidden: torch.Tensor, tokens: torch.Tensor, level: int, visible: torch.Tensor) -> torch.Tensor:
        n, b = self.length, len(tokens)
        positions = torch.full((b,), n + level, device=self.device)
        visible = visible.to(self.device, non_blocking=True)
        mask = torch.cat([torch.ones(b, n, dtype=torch.bool, device=self.device), visible], dim=1)
        past = _concat(self.cache, self._tree_kv)
        tokens = tokens.to(self.device, non_blocking=True)
        out, new_kv = self.run_head(hidden[None], tokens[None], positions, past, mask[None, None], from_target=False)
        self._tree_kv = _concat(self._tree_kv, new_kv)
        return out[0]

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head.logits(hidden).float(), dim=-1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target(draft_ids.to(self.device, non_blocking=True))
