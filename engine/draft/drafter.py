"""The draft side of a generation: the head's own KV cache over committed slots, and tree growth on top of it."""
from __future__ import annotations

import torch

from ..model.cache import GrowingLayer
from .fused import FusedEagle3
from .tree import DraftTree, TreeSpec
from .head import DraftHead


class Drafter:
    """Keeps the head's KV cache for committed slots; a proposal's tree nodes are written past them and dropped by
    not counting them. Buffers with room to grow (engine.model.cache.GrowingLayer), so a round copies only its new keys,
    not the whole context as concatenation did.

    Slot p pairs the base feature after token p with token p+1, so each round commits the features of the
    accepted path together with the tokens that follow them (the accepted drafts, then the bonus token). A round
    defers its slots: the next proposal runs the head over every slot committed since, in one call, a few rows
    costing about what one does, and a round that drafts without the head (the context's chains fill its tree, or
    engine.decode.gate rests the head) costs the head nothing.
    """

    def __init__(self, head: DraftHead, fused: bool = True):
        """fused: run the head's layer as one kernel call where engine.draft.fused describes it (the same bits)."""
        self.head = head
        self.fused = FusedEagle3.of(head) if fused else None
        self.device = head.fc.weight.device
        self.cache: list[GrowingLayer] = []  # one per head layer, created by the first commit
        self._fed = 0  # tree nodes of this proposal written after the committed slots
        self._last_hidden: torch.Tensor | None = None
        self._last_logits: torch.Tensor | None = None  # its draft logits, where the fused head computed them too
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # slots committed but not yet run through the head

    @property
    def length(self) -> int:
        """Slots the head's cache holds."""
        return self.cache[0].length if self.cache else 0

    @property
    def deferred(self) -> int:
        """Slots committed with defer, not yet run through the head."""
        return sum(len(tokens) for _, tokens in self._deferred)

    def reset(self, cache: list[GrowingLayer] | None = None) -> None:
        """Start over, or from `cache` (a kept prefix's slots: engine.decode.prefixes)."""
        self.cache, self._fed, self._deferred = cache or [], 0, []
        self._last_hidden = self._last_logits = None

    def _run(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
             from_target: bool, start: int, logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head over new slots that see the positions before `start` and, as mask says (None: causally), each
        other; their keys and values go in at `start`. Returns their outputs and, where the fused head computes them
        in the same call and `logits` asks, the last one's draft logits (else None)."""
        if self.fused is not None:
            self.cache = self.cache or [GrowingLayer()]
            return self.fused.run(hidden, tokens, positions, mask, self.cache[0], start, from_target, logits)
        if mask is None:
            t = tokens.shape[-1]
            causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
            mask = torch.cat([torch.ones(t, start, dtype=torch.bool, device=self.device), causal], dim=1)[None, None]
        past = [layer.first(start) for layer in self.cache] if start else None
        out, new_kv = self.head(hidden, tokens, positions, past, mask, from_target=from_target)
        self.cache = self.cache or [GrowingLayer() for _ in new_kv]
        for layer, (keys, values) in zip(self.cache, new_kv):
            layer.write(start, keys, values)
        return out, None

    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor, defer: bool = False) -> None:
        """Append slots (features[i], next_tokens[i]); keep the head's output at the last one for the next tree.
        defer: only remember them, for the next commit or proposal to run."""
        self._deferred.append((features, next_tokens))
        if not defer:
            self.catch_up()

    @torch.inference_mode()
    def catch_up(self, logits: bool = True) -> None:
        """Run the head over the deferred slots, if any. logits: also the last slot's draft logits, which the next
        proposal's root reads (an answer's end keeps only the cache)."""
        if not self._deferred:
            return
        if len(self._deferred) == 1:
            (features, next_tokens), = self._deferred
        else:
            features = torch.cat([f for f, _ in self._deferred])
            next_tokens = torch.cat([t for _, t in self._deferred])
        self._deferred = []
        t, n = len(next_tokens), self.length
        positions = torch.arange(n, n + t, device=self.device)
        out, self._last_logits = self._run(features[None].to(self.device),
                                           next_tokens[None].to(self.device, non_blocking=True), positions, None,
                                           True, n, logits=logits)
        for layer in self.cache:
            layer.length = n + t
        self._fed = 0
        self._last_hidden = out[0, -1]

    @torch.inference_mode()
    def propose(self, root: int, tree: TreeSpec) -> DraftTree:
        """Grow the tree `tree` specifies under `root`, from the head's output at the last committed slot."""
        self.catch_up()
        self._fed = 0
        return tree.grow(self, root, self._last_hidden)

    # Expander protocol, used by engine/draft/tree.py
    @torch.inference_mode()
    def expand(self, hidden: torch.Tensor, tokens: torch.Tensor, level: int, visible: torch.Tensor) -> torch.Tensor:
        n, b = self.length, len(tokens)
        positions = torch.full((b,), n + level, device=self.device)
        visible = visible.to(self.device, non_blocking=True)
        mask = torch.cat([torch.ones(b, n, dtype=torch.bool, device=self.device), visible], dim=1)
        tokens = tokens.to(self.device, non_blocking=True)
        out, _ = self._run(hidden[None], tokens[None], positions, mask[None, None], False, n + self._fed)
        self._fed += b
        return out[0]

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax((self.fused or self.head).logits(hidden).float(), dim=-1)

    def root_log_probs(self, root_hidden: torch.Tensor) -> torch.Tensor:
        """The root's are the last committed slot's: the fused head computed its logits in the catch-up's call."""
        if self._last_logits is not None:
            return torch.log_softmax(self._last_logits, dim=-1)
        return self.log_probs(root_hidden[None])[0]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target(draft_ids.to(self.device, non_blocking=True))
