"""Acceptance: which drafted tokens the base model keeps, and the token it adds itself (the bonus).

Greedy takes the longest path whose every token is the base model's argmax. Sampling walks the tree from the
root: at each node the children (deterministic top-k drafts, so q = 1) are tried in rank order, each accepted
with its probability under the base distribution; a rejected child is removed from that distribution, which is
renormalised. Drawing this way is exactly drawing from the base distribution, so the output is lossless.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..draft.tree import DraftTree
from ..flags import flag


@dataclass(frozen=True)
class Sampling:
    """Temperature 0 means greedy; otherwise temperature, then top-k, then top-p, as transformers applies them."""

    temperature: float = field(default=0.0, metadata=flag("--temperature", "0 = greedy", type=float))
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def processors(self) -> LogitsProcessorList:
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            procs.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            procs.append(TopPLogitsWarper(self.top_p))
        return procs

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Target distribution [..., V] (float32) after the warpers."""
        flat = logits.float().reshape(-1, logits.shape[-1])
        flat = self.processors()(None, flat)
        return torch.softmax(flat, dim=-1).reshape(logits.shape)

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """The next token from one row of logits: argmax, or a draw from the warped distribution."""
        if self.greedy:
            return greedy_tokens(logits)
        return int(torch.multinomial(self.probs(logits).cpu(), 1, generator=generator))


def greedy_tokens(logits: torch.Tensor) -> int | list[int]:
    """The argmax of logits [V] or of each row of [N, V], the first of equal maxima as torch's: on the CPU numpy's,
    which is far quicker than torch's over a large vocabulary, next to a plain step that costs a few ms."""
    best = logits.numpy().argmax(-1) if logits.device.type == "cpu" else logits.argmax(-1)
    return best.tolist()


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path of drafts equal to the base argmax. Returns node indices (root first) and the bonus token."""
    best = greedy_tokens(logits)
    tokens, kids = tree.tokens.tolist(), tree.children()
    path = [0]
    while True:
        node = path[-1]
        match = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if match is None:
            return path, best[node]
        path.append(match)


def accept_sampling(
    tree: DraftTree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Lossless tree speculative sampling with deterministic drafts (q = 1 for every proposed child)."""
    tokens, kids = tree.tokens.tolist(), tree.children()
    path = [0]
    while True:
        node = path[-1]
        p = sampling.probs(logits[node]).cpu().double()
        accepted = None
        tried = set()
        for child in kids[node]:
            x = tokens[child]
            if x in tried:
                continue
            tried.add(x)
            if torch.rand((), generator=generator, dtype=torch.float64) < p[x]:
                accepted = child
                break
            p[x] = 0.0
            p /= p.sum()  # positive: a token holding all the mass is accepted with probability 1
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
