"""One speculative round, phase by phase: draft a tree, verify it in one base forward, accept a path, commit it.

Each phase hands a typed value to the next: the drafter proposes a DraftTree (the head's, with the context's chains
grafted on), the base model scores it (Verification), acceptance picks a path (Acceptance), and commit keeps that path
in the base cache and feeds its features to the drafter and its tokens to the context index, so the next round starts
from a clean state. The loop that runs rounds is engine/decode/loop.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import Cache

from ..draft.context import ChainAcceptance, ContextIndex
from ..draft.corpus import CorpusIndex
from ..draft.drafter import Drafter
from ..draft.tree import DraftTree, graft
from ..model.cache import in_place, keep_path
from ..model.placement import wait_for
from ..model.target import Target
from .accept import Sampling, accept_greedy, accept_sampling
from .params import DecodeParams


@dataclass
class Step:
    """One round: the tokens it committed, which came from accepted drafts, and where its time went."""

    tokens: list[int]
    drafted: list[bool]
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    tree_size: int = 0  # drafted nodes the base model verified this round (0 for prefill and plain steps)
    finish_reason: str | None = None  # "eos", "length", "context" on the last step
    kind: str = "speculative"  # "prefill", "speculative" (a drafted tree verified) or "plain" (one token)
    from_context: list[bool] = field(default_factory=list)  # per token: drafted from the context, not by the head
    with_head: bool = False  # a speculative round the draft head took part in (engine.decode.gate may rest it)

    def __post_init__(self):
        self.from_context = self.from_context or [False] * len(self.tokens)

    @property
    def accepted(self) -> int:
        return sum(self.drafted)


@dataclass
class Sequence:
    """Where decoding stands, handed from round to round: the base cache and the last token produced."""

    prompt_len: int
    cache: Cache
    root: int = -1  # the last token produced: the next tree's root, not yet in the base cache
    produced: int = 0  # tokens yielded so far
    context: ContextIndex | None = None  # the prompt and every token produced, when drafting from them
    corpus: CorpusIndex | None = None  # the model's replies to other prompts, when drafting from them too
    acceptance: ChainAcceptance | None = None  # what the context's chains verified so far say pays, if counted

    @property
    def cached(self) -> int:
        """Tokens in the base cache: the prompt and every produced token but the root."""
        return self.prompt_len + self.produced - 1

    def remember(self, tokens: list[int]) -> None:
        """Add tokens now in the text to the context index, when the round drafts from it."""
        if self.context is not None:
            self.context.extend(tokens)


@dataclass
class Verification:
    """The base model's view of a tree: logits and head features for every node, from one forward."""

    tree: DraftTree
    logits: torch.Tensor  # [N, V] float32
    features: torch.Tensor  # [N, F]
    seconds: float


@dataclass
class Acceptance:
    """The accepted path (node indices, root first) and the token the base model adds after it."""

    path: list[int]
    bonus: int

    def tokens(self, tree: DraftTree) -> list[int]:
        """What the round commits: the accepted drafts, then the bonus token."""
        drafts = tree.tokens.tolist()
        return [drafts[node] for node in self.path[1:]] + [self.bonus]


def context_chains(seq: Sequence, params: DecodeParams) -> tuple[list[list[int]], int]:
    """The round's chains from the context (or the corpus), and the length of the match the first continues (0: none
    in the context)."""
    if seq.context is None:
        return [], 0
    match = seq.context.match_length()
    chains = params.context.chains(seq.context, seq.corpus, seq.acceptance)
    return chains, match if match >= params.context.min_match else 0


def draft(drafter: Drafter | None, seq: Sequence, params: DecodeParams, chains: list[list[int]]) -> DraftTree:
    """The round's tree: the context's chains under the root and the head's tree in the budget they leave
    (params.tree.beside); either may be missing: no head (method suffix), no match, context drafting off."""
    head_tree = params.tree.beside(sum(map(len, chains))) if drafter is not None else None
    tree = drafter.propose(seq.root, head_tree) if head_tree is not None else DraftTree.bare(seq.root)
    return graft(tree, chains)


def verify(target: Target, tree: DraftTree, seq: Sequence) -> Verification:
    """Score every tree node in one base forward: each node sees the cached prefix, its ancestors and itself."""
    start = time.perf_counter()
    if tree.is_chain:  # the forward's own causal mask and positions (the same keys, so the same bits), none built
        hidden, features = target.forward(tree.tokens, seq.cache)
    else:
        visible = torch.cat([torch.ones(len(tree), seq.cached, dtype=torch.bool), tree.ancestor_mask()], dim=1)
        hidden, features = target.forward(tree.tokens, seq.cache, seq.cached + tree.depths, visible)
    logits = target.logits(hidden)
    wait_for(logits.device)  # acceptance waits for a GPU anyway; waiting here makes the time the forward's own
    return Verification(tree, logits, features, time.perf_counter() - start)


def accept(verification: Verification, sampling: Sampling, generator: torch.Generator | None) -> Acceptance:
    if sampling.greedy:
        return Acceptance(*accept_greedy(verification.tree, verification.logits))
    return Acceptance(*accept_sampling(verification.tree, verification.logits, sampling, generator))


def commit(seq: Sequence, drafter: Drafter | None, verification: Verification, acceptance: Acceptance) -> list[int]:
    """Keep the accepted path in the base cache, give its features to the drafter and its tokens to the context
    index; returns the new tokens. The drafter runs the new slots when it next drafts: a round whose tree the
    context's chains fill needs no head, and the slots of several rounds then go through the head in one call, a few
    rows costing about what one does."""
    keep_path(seq.cache, seq.cached, acceptance.path)
    tokens = acceptance.tokens(verification.tree)
    if drafter is not None:
        drafter.commit(path_rows(verification.features, acceptance.path), torch.tensor(tokens), defer=True)
    seq.remember(tokens)
    seq.root = acceptance.bonus
    return tokens


def path_rows(rows: torch.Tensor, path: list[int]) -> torch.Tensor:
    """rows[path], a view where the path is in place."""
    if in_place(path):
        return rows[: len(path)]
    return rows[torch.tensor(path, device=rows.device)]


def speculative_round(
    target: Target, drafter: Drafter | None, seq: Sequence, params: DecodeParams, generator: torch.Generator | None,
    head: bool = True,
) -> Step:
    """Draft a tree from the root, verify it, accept a path, commit it. head=False: draft from the context alone
    (engine.decode.gate)."""
    start = time.perf_counter()
    chains, match = context_chains(seq, params)
    tree = draft(drafter if head else None, seq, params, chains)
    drafted = time.perf_counter()
    verification = verify(target, tree, seq)
    acceptance = accept(verification, params.sampling, generator)
    committing = time.perf_counter()
    tokens = commit(seq, drafter, verification, acceptance)
    if seq.acceptance is not None and chains and match:
        seq.acceptance.observe(match, chains[0], tokens)
    draft_s = (drafted - start) + (time.perf_counter() - committing)  # the drafter's catch-up is drafting work
    from_context = path_rows(tree.from_context, acceptance.path)[1:].tolist() + [False]
    return Step(tokens, [True] * (len(tokens) - 1) + [False], draft_s=draft_s, verify_s=verification.seconds,
                tree_size=len(tree) - 1, from_context=from_context, with_head=head and drafter is not None)
