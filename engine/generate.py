"""The decoding loop: a prefill, then one round per base-model forward, each yielding a Step.

A speculative round hands typed values from phase to phase: the drafter proposes a DraftTree (the head's, with the
context's chains grafted on: `draft`), the base model scores it in one forward (Verification), acceptance picks
a path (Acceptance), and commit keeps that path in the base cache and feeds its features to the drafter and its
tokens to the context index, so the next round starts from a clean state. A plain step (all
`vanilla` does, and what any method falls back to near the context limit) is one forward for one token.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import Cache

from .cache import keep_path
from .context import ContextIndex
from .corpus import CorpusIndex
from .draft.drafter import Drafter
from .gate import HeadGate
from .params import DecodeParams
from .target import Target
from .tree import DraftTree, graft
from .verify import Sampling, accept_greedy, accept_sampling


class ContextTooLong(ValueError):
    """The prompt leaves no room in the model's context window."""


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
    with_head: bool = False  # a speculative round the draft head took part in (engine.gate may rest it)

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
        return tree.tokens[self.path[1:]].tolist() + [self.bonus]


def check_prompt(prompt_ids: list[int], max_context: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= max_context:
        raise ContextTooLong(f"the prompt has {len(prompt_ids)} tokens; the model's context holds {max_context}")


def prefill(
    target: Target, drafter: Drafter | None, prompt_ids: list[int], seq: Sequence, sampling: Sampling,
    generator: torch.Generator | None,
) -> Step:
    """The prompt in one forward: the first token, and the drafter's cache and the context index over the prompt.
    Positions a kept prefix already holds (engine.prefixes: the cache and the drafter's first ones) are not run."""
    start = time.perf_counter()
    done = seq.cache.get_seq_length()
    prompt = torch.tensor(prompt_ids)
    hidden, features = target.forward(prompt[done:], seq.cache)
    seq.root = sampling.pick(target.logits(hidden[-1]), generator)
    verified = time.perf_counter()
    if drafter is not None:
        if not done:  # else it holds the kept prefix's slots (Engine)
            drafter.reset()
        drafter.commit(features, torch.cat([prompt[done + 1:], torch.tensor([seq.root])]))
    seq.remember(prompt_ids + [seq.root])
    return Step([seq.root], [False], verify_s=verified - start, draft_s=time.perf_counter() - verified, kind="prefill")


def plain_step(
    target: Target, seq: Sequence, sampling: Sampling, generator: torch.Generator | None,
    drafter: Drafter | None = None,
) -> Step:
    """One base forward for one token: plain decoding. A drafter that will draft again is handed the new slot, to
    run at its next proposal (so that a run of plain steps is base forwards back to back, as plain decoding is),
    the context index the new token."""
    start = time.perf_counter()
    hidden, features = target.forward(torch.tensor([seq.root]), seq.cache)
    seq.root = sampling.pick(target.logits(hidden[-1]), generator)
    verified = time.perf_counter()
    if drafter is not None:
        drafter.commit(features, torch.tensor([seq.root]), defer=True)
    seq.remember([seq.root])
    return Step([seq.root], [False], verify_s=verified - start, draft_s=time.perf_counter() - verified, kind="plain")


def draft(drafter: Drafter | None, seq: Sequence, params: DecodeParams) -> DraftTree:
    """The round's tree: the context's chains under the root and the head's tree in the budget they leave
    (params.tree.beside); either may be missing: no head (method suffix), no match, context drafting off."""
    chains = params.context.chains(seq.context, seq.corpus) if seq.context is not None else []
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
    if logits.is_cuda:  # acceptance waits for the GPU anyway; waiting here makes the time the forward's own
        torch.cuda.synchronize(logits.device)
    return Verification(tree, logits, features, time.perf_counter() - start)


def accept(verification: Verification, sampling: Sampling, generator: torch.Generator | None) -> Acceptance:
    if sampling.greedy:
        return Acceptance(*accept_greedy(verification.tree, verification.logits))
    return Acceptance(*accept_sampling(verification.tree, verification.logits, sampling, generator))


def commit(
    seq: Sequence, drafter: Drafter | None, verification: Verification, acceptance: Acceptance, defer: bool = False
) -> list[int]:
    """Keep the accepted path in the base cache, give its features to the drafter (deferred: for its next drafting
    round to run) and its tokens to the context index; returns the new tokens."""
    path = torch.tensor(acceptance.path)
    keep_path(seq.cache, seq.cached, path)
    tokens = acceptance.tokens(verification.tree)
    if drafter is not None:
        features = verification.features[path.to(verification.features.device, non_blocking=True)]
        drafter.commit(features, torch.tensor(tokens), defer)
    seq.remember(tokens)
    seq.root = acceptance.bonus
    return tokens


def speculative_round(
    target: Target, drafter: Drafter | None, seq: Sequence, params: DecodeParams, generator: torch.Generator | None,
    head: bool = True,
) -> Step:
    """Draft a tree from the root, verify it, accept a path, commit it. head=False: draft from the context alone
    and defer the drafter's slots (engine.gate)."""
    start = time.perf_counter()
    tree = draft(drafter if head else None, seq, params)
    drafted = time.perf_counter()
    verification = verify(target, tree, seq)
    acceptance = accept(verification, params.sampling, generator)
    committing = time.perf_counter()
    tokens = commit(seq, drafter, verification, acceptance, defer=not head)
    draft_s = (drafted - start) + (time.perf_counter() - committing)  # the drafter's catch-up is drafting work
    return Step(tokens, [True] * (len(tokens) - 1) + [False], draft_s=draft_s, verify_s=verification.seconds,
                tree_size=len(tree) - 1, from_context=tree.from_context[acceptance.path[1:]].tolist() + [False],
                with_head=head and drafter is not None)


def finish(step: Step, seq: Sequence, params: DecodeParams, stop_ids: set[int], max_context: int) -> Step:
    """Cut the step at a stop token or the token budget, count its tokens, and say why decoding ends, if it does."""
    for i, token in enumerate(step.tokens):
        if token in stop_ids or seq.produced + i + 1 >= params.max_new_tokens:
            step.finish_reason = "eos" if token in stop_ids else "length"
            step.tokens, step.drafted, step.from_context = (
                step.tokens[: i + 1], step.drafted[: i + 1], step.from_context[: i + 1])
            break
    seq.produced += len(step.tokens)
    if step.finish_reason is None and seq.prompt_len + seq.produced >= max_context:
        step.finish_reason = "context"
    return step


def decode(
    target: Target, drafter: Drafter | None, prompt_ids: list[int], params: DecodeParams,
    stop_ids: tuple[int, ...] = (), cache: Cache | None = None, gate: HeadGate | None = None,
    corpus: CorpusIndex | None = None,
) -> Iterator[Step]:
    """Generate from prompt_ids, one Step per base-model forward. Closing the iterator stops decoding at once (at a
    yield, where the cache and the drafter hold exactly the tokens yielded so far, and the ones a cut step dropped).
    cache: a new one by default; else one holding the prompt's first positions, the drafter the same slots.
    gate: the head gate params.gate asks for, carried over from earlier generations (default: a new one).
    corpus: what to draft from where the context has nothing, if params.corpus asks for it."""
    check_prompt(prompt_ids, target.max_context)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    stops, sampling = set(stop_ids), params.sampling
    cache = target.new_cache() if cache is None else cache
    context = params.drafts_from_context
    seq = Sequence(len(prompt_ids), cache, context=ContextIndex() if context else None,
                   corpus=corpus if context and params.corpus else None)
    gate = (gate or HeadGate()) if params.gated and drafter is not None else None
    start = time.perf_counter()
    step = prefill(target, drafter, prompt_ids, seq, sampling, generator)
    for index in itertools.count():
        step = finish(step, seq, params, stops, target.max_context)
        step.wall_s = time.perf_counter() - start
        if gate is not None and step.kind == "speculative":  # the meter's plain runs time neither arm
            gate.observe(len(step.tokens), step.wall_s)
        yield step
        if step.finish_reason:
            return
        start = time.perf_counter()
        # Near the context limit a tree no longer fits: finish with plain steps (the cache only grows from here).
        drafts = drafter is not None or seq.context is not None
        drafting = drafts and seq.cached + params.max_levels + 1 <= target.max_context
        if drafting and not params.plain_round(index):
            step = speculative_round(target, drafter, seq, params, generator, head=gate is None or gate.head)
        else:
            step = plain_step(target, seq, sampling, generator, drafter if drafting else None)
