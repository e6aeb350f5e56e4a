"""The decoding loop, one round at a time: draft a tree, verify it in one base forward, accept, compact, yield.

`vanilla` runs the same loop with no drafting (one base forward per token): the honest baseline.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .cache import keep_path
from .draft.drafter import Drafter
from .target import Target
from .tree import MC_SIM_7B_63
from .verify import Sampling, accept_greedy, accept_sampling

METHODS = ("vanilla", "eagle")
TREES = ("dynamic", "static")


class ContextTooLong(ValueError):
    """The prompt leaves no room in the model's context window."""


@dataclass
class DecodeParams:
    """Decoding settings. Tree defaults were chosen by measurement on a 2-core CPU (see README)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    tree: str = "dynamic"
    # Tree defaults tuned for the shipped head on a CPU in bf16 (README, "Tree size"): with a head that accepts ~2
    # tokens a round, small shallow trees win there; on a GPU, or with a better head, larger trees pay off.
    total_tokens: int = 8  # tree nodes including the root (the official `total_token`)
    depth: int = 2  # expansion steps: the tree reaches depth + 1 drafted levels
    draft_top_k: int = 8
    static_tree: list[list[int]] = field(default_factory=lambda: MC_SIM_7B_63)
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.tree not in TREES:
            raise ValueError(f"unknown tree {self.tree!r}; choose one of {', '.join(TREES)}")
        if self.depth < 1 or self.draft_top_k < 1 or self.total_tokens < 2:
            raise ValueError("depth and draft_top_k must be >= 1 and total_tokens >= 2")
        self.sampling = Sampling(self.temperature, self.top_p, self.top_k)

    @property
    def max_levels(self) -> int:
        """Deepest drafted level a tree can have."""
        return self.depth + 1 if self.tree == "dynamic" else max(map(len, self.static_tree))


@dataclass
class Step:
    """One round: the tokens it committed, which came from accepted drafts, and where its time went."""

    tokens: list[int]
    drafted: list[bool]
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    tree_size: int = 0  # drafted nodes the base model verified this round (0 for prefill and vanilla)
    finish_reason: str | None = None  # "eos", "length", "context" on the last step

    @property
    def accepted(self) -> int:
        return sum(self.drafted)


def check_prompt(prompt_ids: list[int], max_context: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= max_context:
        raise ContextTooLong(f"the prompt has {len(prompt_ids)} tokens; the model's context holds {max_context}")


def decode(
    target: Target, drafter: Drafter | None, prompt_ids: list[int], params: DecodeParams
) -> Iterator[Step]:
    """Generate from prompt_ids, one Step per base-model forward. Closing the iterator stops decoding at once."""
    check_prompt(prompt_ids, target.max_context)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    sampling, stops = params.sampling, set(params.stop_ids)
    cache = target.new_cache()
    produced = 0

    def finish(step: Step, start: float) -> Step:
        """Cut the step at a stop token or the token budget, and stamp its wall time."""
        nonlocal produced
        for i, tok in enumerate(step.tokens):
            if tok in stops or produced + i + 1 >= params.max_new_tokens:
                step.finish_reason = "eos" if tok in stops else "length"
                step.tokens, step.drafted = step.tokens[: i + 1], step.drafted[: i + 1]
                break
        produced += len(step.tokens)
        if step.finish_reason is None and len(prompt_ids) + produced >= target.max_context:
            step.finish_reason = "context"
        step.wall_s = time.perf_counter() - start
        return step

    start = time.perf_counter()
    prompt = torch.tensor(prompt_ids)
    hidden, features = target.forward(prompt, cache)
    root = sampling.pick(target.logits(hidden[-1]), generator)
    step = finish(Step([root], [False], verify_s=time.perf_counter() - start), start)
    yield step
    if step.finish_reason:
        return
    if drafter is not None:
        drafter.reset()
        pending = (features, torch.cat([prompt[1:], torch.tensor([root])]))

    while True:
        start = time.perf_counter()
        committed = len(prompt_ids) + produced - 1  # tokens in the base cache; `root` is not yet in it
        # Near the context limit a tree no longer fits: finish with plain steps (committed only grows from here).
        if drafter is None or committed + params.max_levels + 1 > target.max_context:
            hidden, _ = target.forward(torch.tensor([root]), cache)
            root = sampling.pick(target.logits(hidden[-1]), generator)
            step = Step([root], [False], verify_s=time.perf_counter() - start)
        else:
            drafter.commit(*pending)
            tree = drafter.propose(
                root, params.tree, params.draft_top_k, params.depth, params.total_tokens, params.static_tree
            )
            draft_done = time.perf_counter()
            visible = torch.cat([torch.ones(len(tree), committed, dtype=torch.bool), tree.ancestor_mask()], dim=1)
            hidden, features = target.forward(tree.tokens, cache, committed + tree.depths, visible)
            logits = target.logits(hidden)
            if logits.is_cuda:  # acceptance waits for the GPU anyway; waiting here makes verify_s its real time
                torch.cuda.synchronize(logits.device)
            verify_done = time.perf_counter()
            if sampling.greedy:
                path, bonus = accept_greedy(tree, logits)
            else:
                path, bonus = accept_sampling(tree, logits, sampling, generator)
            path_index = torch.tensor(path)
            keep_path(cache, committed, path_index)
            accepted = tree.tokens[path[1:]].tolist()
            pending = (features[path_index.to(features.device, non_blocking=True)], torch.tensor(accepted + [bonus]))
            root = bonus
            step = Step(
                accepted + [bonus], [True] * len(accepted) + [False],
                draft_s=draft_done - start, verify_s=verify_done - draft_done, tree_size=len(tree) - 1,
            )
        step = finish(step, start)
        yield step
        if step.finish_reason:
            return
