"""Prefixes kept from one generation to the next, so that a chat's next turn forwards only its new tokens.

Each turn's prompt is the whole conversation so far, which the previous turn already ran through the base model
(and the head): prefilling it again costs more with every turn. The store keeps the caches the last few
generations left, with the token ids they hold, and hands the one sharing the longest prefix with a new prompt
back, cut to that prefix (as llama.cpp's server keeps a slot's prompt cache).

Only for a batch-invariant engine (Engine.batch_invariant): there every cached position has the very bits a
fresh prefill would give it (the property that makes greedy EAGLE plain decoding), so reusing one changes no
output. The head's own cache only shapes drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.cache import GrowingCache, GrowingLayer, truncate


@dataclass
class Prefix:
    """What a generation left: `ids`, the prompt and every token it produced; the base cache holds positions for
    their first len(ids) - 1 (or more, past a stop token it cut), the head's cache `head_length` slots, slot p
    pairing position p's features with ids[p + 1] (None: decoded without a head)."""

    ids: list[int]
    cache: GrowingCache
    head_cache: list[GrowingLayer] | None = None

    @property
    def head_length(self) -> int:
        return self.head_cache[0].length if self.head_cache else 0

    def usable(self, prompt_ids: list[int], with_head: bool) -> int:
        """How many leading positions a generation of `prompt_ids` can take from here: within the common prefix
        (the last common token's slot pairs it with the next id, so one short of it), leaving the prompt's last token
        to forward for the first new token's logits, and within the head's slots when it drafts."""
        common = 0
        for ours, theirs in zip(self.ids, prompt_ids):
            if ours != theirs:
                break
            common += 1
        usable = min(common - 1, self.cache.get_seq_length(), len(prompt_ids) - 1)
        if with_head:
            usable = min(usable, self.head_length)
        return max(usable, 0)


class PrefixStore:
    """The last `capacity` generations' prefixes, the most recent last (an f16 cache of the embedded model holds
    ~23 KB a token: four 2,000-token chats ~0.2 GB)."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self.entries: list[Prefix] = []

    def take(self, prompt_ids: list[int], with_head: bool) -> Prefix | None:
        """Remove and return the prefix sharing the most positions with `prompt_ids`, its caches cut to them; None
        when none shares any."""
        usable = [entry.usable(prompt_ids, with_head) for entry in self.entries]
        if not usable or max(usable) == 0:
            return None
        best = usable.index(max(usable))
        entry = self.entries.pop(best)
        truncate(entry.cache, usable[best])
        if with_head:
            for layer in entry.head_cache:
                layer.length = usable[best]
        return entry

    def put(self, prefix: Prefix) -> None:
        self.entries = (self.entries + [prefix])[-self.capacity:]
