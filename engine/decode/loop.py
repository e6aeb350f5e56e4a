"""The decoding loop: a prefill, then one round per base-model forward, each yielding a Step.

A round is speculative (engine/decode/round.py: draft, verify, accept, commit) or a plain step: one forward for one
token, all `vanilla` does and what any method falls back to near the context limit.
"""
from __future__ import annotations

import itertools
import time
from typing import Iterator

import torch
from transformers import Cache

from ..draft.context import ChainAcceptance, ContextIndex
from ..draft.corpus import CorpusIndex
from ..draft.drafter import Drafter
from ..model.target import Target
from .accept import Sampling
from .gate import HeadGate
from .params import DecodeParams
from .round import Sequence, Step, speculative_round


class ContextTooLong(ValueError):
    """The prompt leaves no room in the model's context window."""


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
    Positions a kept prefix already holds (engine.decode.prefixes: the cache and the drafter's first ones) are not run."""
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
    corpus: CorpusIndex | None = None, acceptance: ChainAcceptance | None = None,
) -> Iterator[Step]:
    """Generate from prompt_ids, one Step per base-model forward. Closing the iterator stops decoding at once (at a
    yield, where the cache and the drafter hold exactly the tokens yielded so far, and the ones a cut step dropped).
    cache: a new one by default; else one holding the prompt's first positions, the drafter the same slots.
    gate: the head gate params.gate asks for, carried over from earlier generations (default: a new one).
    corpus: what to draft from where the context has nothing, if params.corpus asks for it.
    acceptance: the context's chains verified so far, carried over from earlier generations, to size this one's
    (engine.draft.context.ChainAcceptance; default: ContextDraft's lengths as they are)."""
    check_prompt(prompt_ids, target.max_context)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    stops, sampling = set(stop_ids), params.sampling
    cache = target.new_cache() if cache is None else cache
    context = params.drafts_from_context
    seq = Sequence(len(prompt_ids), cache, context=ContextIndex() if context else None,
                   corpus=corpus if context and params.corpus else None, acceptance=acceptance)
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
