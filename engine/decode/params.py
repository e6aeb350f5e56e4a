"""Decoding settings as one value, built where a request enters (library call, UI, benchmark, API) and handed
whole to the decoding loop. Every default is declared once, here and in the objects it holds."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..draft.context import ContextDraft
from ..draft.tree import TREES, DynamicTree, TreeSpec
from ..flags import flag
from .accept import Sampling

METHODS = ("vanilla", "eagle", "suffix")
MAX_FLOOR = 0.95  # the highest draft floor a measured row cost sets: a draft the head is that sure of is verified
_SAMPLING_OPTIONS = ("temperature", "top_p", "top_k")
# flat option names (with_options, the bench's flags) -> DynamicTree fields
DYNAMIC_TREE_OPTIONS = {"total_tokens": "total_tokens", "depth": "depth", "draft_top_k": "top_k",
                        "min_prob": "min_prob"}


@dataclass(frozen=True)
class DecodeParams:
    """How to answer one request: the method, the answer's length, how to pick tokens, which tree to draft."""

    # "vanilla": no drafting, one base forward per token (the honest baseline); "eagle": the head's tree, with the
    # context's chains grafted on unless context is None; "suffix": the context's chains alone (no head needed)
    method: str = "eagle"
    max_new_tokens: int = field(default=256, metadata=flag(
        "--max-new-tokens", "new tokens per answer at most", type=int))
    sampling: Sampling = field(default_factory=Sampling)
    tree: TreeSpec = field(default_factory=DynamicTree)
    context: ContextDraft | None = field(default_factory=ContextDraft)  # None: no drafting from the context
    # where the context drafts nothing, draft from the engine's corpus of the model's own replies (Engine.corpus),
    # when it has one; part of context drafting, so off with it
    corpus: bool = True
    seed: int | None = field(default=None, metadata=flag(
        "--seed", "sampling seed, set before every generation", type=int))
    # Every n rounds a speculative method decodes a run of `plain_run` plain steps instead (0: never), timed
    # like plain decoding under the turn's own conditions: the app's speedup meter divides by them. The output does
    # not change (a plain step commits what the round would have: the base model's own token).
    plain_every: int = 0
    plain_run: int = 1
    # eagle: draft with the head only in the rounds where measuring says it pays (engine.decode.gate); off, the head drafts
    # every round, as EAGLE does. Either way the output has the same law (greedy: the same tokens); see `gated`.
    gate: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.plain_every < 0:
            raise ValueError(f"plain_every must be >= 0 (0 = never), got {self.plain_every}")
        if self.plain_every and not 1 <= self.plain_run <= self.plain_every:
            raise ValueError(f"plain_run must be between 1 and plain_every ({self.plain_every}), got {self.plain_run}")
        if self.method == "suffix" and self.context is None:
            raise ValueError("method 'suffix' drafts from the context: it cannot run with context drafting off")

    @property
    def drafts_from_context(self) -> bool:
        return self.context is not None and self.method != "vanilla"

    @property
    def adapts(self) -> bool:
        """Whether the drafts may follow what was measured before (the head gate's arms, the context's chains sized
        by their acceptance): unless a seed is given for sampling, as a seeded sampler's draws follow the drafts and
        what was measured follows the machine and earlier answers, so the same seed would not give the same answer
        twice."""
        return self.sampling.greedy or self.seed is None

    @property
    def sizes_chains(self) -> bool:
        """Whether the context's chains are cut to what their acceptance so far says pays (ContextDraft.sized)."""
        return self.drafts_from_context and self.context.sized and self.adapts

    @property
    def floors_at_row_cost(self) -> bool:
        """Whether the head's drafts are kept only where the head gives them at least a verified row's cost in plain
        steps (DynamicTree.min_prob None), where the drafts may adapt: the cost is measured per machine."""
        return self.method == "eagle" and isinstance(self.tree, DynamicTree) and self.tree.min_prob is None and \
            self.adapts

    def with_row_cost(self, row_cost: float) -> DecodeParams:
        """A copy whose head tree keeps the drafts the head gives at least `row_cost` (floors_at_row_cost), else
        itself."""
        if not self.floors_at_row_cost:
            return self
        return replace(self, tree=replace(self.tree, min_prob=min(row_cost, MAX_FLOOR)))

    @property
    def gated(self) -> bool:
        """Whether the head gate decides the rounds: asked for, where the drafts may adapt."""
        return self.gate and self.method == "eagle" and self.adapts

    @property
    def max_levels(self) -> int:
        """Deepest drafted level a round's tree can have: the head's tree or the context's longest chain."""
        head = self.tree.max_levels if self.method == "eagle" else 0
        context = max(self.context.max_tokens, self.context.corpus_max_tokens) if self.drafts_from_context else 0
        return max(head, context)

    def plain_round(self, index: int) -> bool:
        """Whether decoding round `index` (0 = the first after the prefill) is a plain step: runs of plain_run from
        rounds n/2, 3n/2, 5n/2, ... (n = plain_every), the first past an answer's start-up, which a page's first
        update (rendered beside it) slows."""
        offset = index - self.plain_every // 2
        return self.plain_every > 0 and offset >= 0 and offset % self.plain_every < self.plain_run

    def with_options(self, **options) -> DecodeParams:
        """A copy with flat options changed, the shape command-line flags, UI controls and API fields arrive in:
        temperature, top_p, top_k (sampling); tree ("dynamic" or "static"); total_tokens, depth, draft_top_k, min_prob
        (the dynamic tree); context (True or False: draft from the context, or a ContextDraft); and this class's own
        fields."""
        sampling = {name: options.pop(name) for name in _SAMPLING_OPTIONS if name in options}
        shape = {key: options.pop(name) for name, key in DYNAMIC_TREE_OPTIONS.items() if name in options}
        tree = options.pop("tree", self.tree)
        if isinstance(tree, str):
            if tree not in TREES:
                raise ValueError(f"unknown tree {tree!r}; choose one of {', '.join(TREES)}")
            tree = self.tree if isinstance(self.tree, TREES[tree]) else TREES[tree]()
        if shape:
            if not isinstance(tree, DynamicTree):
                raise ValueError(f"{', '.join(shape)} shape the dynamic tree; a static tree has fixed paths")
            tree = replace(tree, **shape)
        if isinstance(options.get("context"), bool):
            options["context"] = (self.context or ContextDraft()) if options["context"] else None
        unknown = sorted(set(options) - {f.name for f in fields(self)})
        if unknown:
            known = [f.name for f in fields(self) if f.name != "sampling"] + [*_SAMPLING_OPTIONS, *DYNAMIC_TREE_OPTIONS]
            raise TypeError(f"unknown decoding option {', '.join(unknown)}; known: {', '.join(known)}")
        return replace(self, sampling=replace(self.sampling, **sampling), tree=tree, **options)
