"""Draft trees: EAGLE-2's dynamic tree and EAGLE-1's static trees, as flat node lists (root first, parents
before children) with the ancestor mask and depths that verification needs, the specifications
(`DynamicTree`, `StaticTree`) that say which tree a round grows, and the grafting of the context's chains."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol, Union

import torch

from ..flags import flag

# EAGLE-1's published static tree `mc_sim_7b_63`: each path lists child ranks from the root (0 = top-1 draft).
MC_SIM_7B_63 = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] base-vocabulary ids; node 0 is the root (the last token the base model produced)
    parents: torch.Tensor  # [N] parent node index, -1 for the root
    # [N] bool: the node was drafted from the context, not by the head (provenance only: verification ignores it)
    from_context: torch.Tensor | None = None

    def __post_init__(self):
        depths = [0] * len(self.parents)
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            depths[i] = depths[p] + 1
        self.depths = torch.tensor(depths, dtype=torch.long)
        self.is_chain = depths == list(range(len(depths)))  # each node the child of the one before: causal
        if self.from_context is None:
            self.from_context = torch.zeros(len(self.tokens), dtype=torch.bool)

    @classmethod
    def bare(cls, root: int) -> DraftTree:
        """The root alone: what a round has before any draft."""
        return cls(tokens=torch.tensor([root]), parents=torch.tensor([-1]))

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [N, N]: node i sees node j iff j is i or one of its ancestors."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        rows, cur = torch.arange(n), self.parents.clone()
        while (cur >= 0).any():
            ok = cur >= 0
            mask[rows[ok], cur[ok]] = True
            cur[ok] = self.parents[cur[ok]]
        return mask

    def children(self) -> list[list[int]]:
        """Children of each node in draft-rank order (node order), for acceptance."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return kids


class Expander(Protocol):
    """What growing a tree needs from the draft head."""

    def expand(self, hidden: torch.Tensor, tokens: torch.Tensor, level: int, visible: torch.Tensor) -> torch.Tensor:
        """Feed tree nodes; visible[i, j]: node i sees the j-th fed node (itself included). Returns hidden outputs."""

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [k, V_d] over the draft vocabulary."""

    def root_log_probs(self, root_hidden: torch.Tensor) -> torch.Tensor:
        """The root's draft log-probabilities [V_d] (log_probs of root_hidden, or what the drafter has of them)."""

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Base-vocabulary ids of draft-vocabulary ids."""


class _FedNodes:
    """Tracks which tree nodes went through the head, so each new node sees exactly its fed ancestors."""

    def __init__(self, expander: Expander, device: torch.device):
        self.expander = expander
        self.rows = torch.zeros(0, 0, dtype=torch.bool, device=device)

    def feed(self, hidden: torch.Tensor, tokens: torch.Tensor, parent_rows: torch.Tensor, level: int):
        """parent_rows: index into earlier fed nodes for each new node, -1 when its parent is the root."""
        n, b, device = self.rows.shape[0], len(tokens), self.rows.device
        parent_rows = parent_rows.to(device, non_blocking=True)
        # Rows of a root child inherit nothing: gather from a zero row appended below the fed rows (no host sync).
        padded = torch.cat([self.rows, torch.zeros(1, n, dtype=torch.bool, device=device)], 0)
        inherited = padded[torch.where(parent_rows >= 0, parent_rows, n)]
        new_rows = torch.cat([inherited, torch.eye(b, dtype=torch.bool, device=device)], dim=1)
        widened = torch.cat([self.rows, torch.zeros(n, b, dtype=torch.bool, device=device)], 1)
        self.rows = torch.cat([widened, new_rows], 0)
        return self.expander.expand(hidden, tokens, level, new_rows)


def grow_dynamic(
    expander: Expander, root: int, root_hidden: torch.Tensor, top_k: int, depth: int, total_tokens: int,
    min_prob: float = 0.0,
) -> DraftTree:
    """EAGLE-2: expand the top_k best nodes by cumulative draft log-prob for `depth` steps, keep the best
    total_tokens - 1 candidates, and of those only the ones whose cumulative draft probability is at least min_prob.
    Scores never grow along a path, so a kept node's parent is always kept; and a node ranks behind all its
    ancestors (ties go to the earlier), so levels deeper than the kept count, or whose parents all fall below
    min_prob, are never grown. The tree may be the root alone: then the round is a plain step."""
    device = root_hidden.device
    floor = math.log(min_prob) if min_prob > 0 else -math.inf
    logp = expander.root_log_probs(root_hidden)
    if total_tokens == 2:  # the best draft alone: nothing to grow or rank (the CPU default, every round)
        best = int(logp.argmax())
        if min_prob > 0 and float(logp[best]) < floor:
            return DraftTree.bare(root)
        return DraftTree(tokens=torch.tensor([root, int(expander.to_target(torch.tensor([best])))]),
                         parents=torch.tensor([-1, 0]))
    scores, ids = logp.topk(top_k)
    all_tokens, all_scores = [expander.to_target(ids)], [scores]
    all_parents = [torch.zeros(top_k, dtype=torch.long, device=device)]  # candidate numbers; 0 = root
    frontier = torch.arange(1, top_k + 1, device=device)
    frontier_parent_rows = torch.full((top_k,), -1, device=device)
    hidden, tokens = root_hidden.expand(top_k, -1), all_tokens[0]
    fed = _FedNodes(expander, device)
    next_number = top_k + 1
    for level in range(min(depth, total_tokens - 2)):
        if min_prob > 0 and scores[0] < floor:  # sorted: no child can reach min_prob (on a GPU, a sync)
            break
        out = fed.feed(hidden, tokens, frontier_parent_rows, level)
        fed_rows = torch.arange(fed.rows.shape[0] - top_k, fed.rows.shape[0], device=device)
        child_scores, child_ids = expander.log_probs(out).topk(top_k, dim=-1)
        cum = (scores[:, None] + child_scores).flatten()
        child_tokens = expander.to_target(child_ids).flatten()
        all_tokens.append(child_tokens)
        all_scores.append(cum)
        all_parents.append(frontier.repeat_interleave(top_k))
        scores, sel = cum.topk(top_k)
        parent = sel // top_k
        frontier, frontier_parent_rows = next_number + sel, fed_rows[parent]
        hidden, tokens = out[parent], child_tokens[sel]
        next_number += top_k * top_k

    flat_scores = torch.cat(all_scores)
    keep = min(total_tokens - 1, len(flat_scores) if min_prob <= 0 else int((flat_scores >= floor).sum()))
    order = torch.sort(-flat_scores, stable=True).indices[:keep].sort().values
    number_to_node = torch.full((len(flat_scores) + 1,), -1, dtype=torch.long, device=device)
    number_to_node[0] = 0
    number_to_node[order + 1] = torch.arange(1, keep + 1, device=device)
    parents = number_to_node[torch.cat(all_parents)[order]]
    tokens, parents = torch.cat(all_tokens)[order].cpu(), parents.cpu()  # the round's one sync while drafting
    assert (parents >= 0).all(), "a kept draft node lost its parent"
    return DraftTree(tokens=torch.cat([torch.tensor([root]), tokens]), parents=torch.cat([torch.tensor([-1]), parents]))


def grow_static(expander: Expander, root: int, root_hidden: torch.Tensor, paths: list[list[int]]) -> DraftTree:
    """EAGLE-1: a fixed tree shape; each node is the rank-th best draft token under its parent."""
    paths = sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))
    index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
    missing = [p for p in paths if p[:-1] not in index]
    if missing:
        raise ValueError(f"static tree path {list(missing[0])} has no parent path")
    tokens = [root] + [0] * len(paths)
    expanded = {p[:-1] for p in paths}  # nodes with children, as paths
    hidden_of: dict[tuple, torch.Tensor] = {(): root_hidden}
    fed_row: dict[tuple, int] = {}
    fed = _FedNodes(expander, root_hidden.device)

    def children_of(parents: list[tuple], logp: torch.Tensor) -> None:
        wanted = max(p[-1] for p in paths if p[:-1] in parents) + 1
        ranked = expander.to_target(logp.topk(wanted, dim=-1).indices)
        for parent, ranks in zip(parents, ranked.tolist()):
            for p in paths:
                if p[:-1] == parent:
                    tokens[index[p]] = ranks[p[-1]]

    children_of([()], expander.root_log_probs(root_hidden)[None])
    for level in range(max(map(len, paths)) - 1):
        batch = [p for p in paths if len(p) == level + 1 and p in expanded]
        hidden = torch.stack([hidden_of[p[:-1]] for p in batch])
        toks = torch.tensor([tokens[index[p]] for p in batch])
        parent_rows = torch.tensor([fed_row.get(p[:-1], -1) for p in batch])
        start = fed.rows.shape[0]
        outs = fed.feed(hidden, toks, parent_rows, level)
        for i, p in enumerate(batch):
            hidden_of[p], fed_row[p] = outs[i], start + i
        children_of(batch, expander.log_probs(outs))
    parents = [-1] + [index[p[:-1]] for p in paths]
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's tree: expand the top_k best nodes for `depth` steps, keep the best total_tokens - 1 drafts.

    Defaults tuned for the shipped head on a CPU (docs/benchmarks.md, "Tree size and min_prob"): with a head that
    accepts under 2 tokens a round, small shallow trees win there; on a GPU, or with a better head, larger trees
    pay off.
    """

    total_tokens: int = field(default=2, metadata=flag(  # the official `total_token`
        "--total-tokens", "dynamic tree nodes incl. the root (unset: the tree's own)", type=int, default=None))
    depth: int = field(default=1, metadata=flag(
        "--depth", "dynamic tree expansion steps; it reaches depth + 1 drafted levels (unset: the tree's own)",
        type=int, default=None))
    top_k: int = field(default=2, metadata=flag(
        "--draft-top-k", "children per expanded node (unset: the tree's own)", type=int, default=None))
    # Keep only drafts whose path the head gives at least this probability (0: keep total_tokens - 1 always). The
    # head's cumulative probability tracks acceptance (EAGLE-2), and on a CPU a verified row costs a good share of a
    # plain step, so a draft unlikely to be accepted costs more than it brings. None: as much as a verified row costs
    # in plain steps, where the engine measured it (engine.decode.costs.row_cost; Engine sets it), else 0.
    min_prob: float | None = field(default=None, metadata=flag(
        "--min-prob", "keep only drafts the head gives at least this probability (default: as much as a verified row "
        "costs in plain steps, measured on this machine; 0 keeps every draft)", type=float))

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise ValueError("tree depth and draft top-k must be >= 1 and total_tokens >= 2")
        if self.min_prob is not None and not 0 <= self.min_prob < 1:
            raise ValueError(f"min_prob must be in [0, 1), got {self.min_prob}")

    @property
    def max_levels(self) -> int:
        """Deepest drafted level the tree can have."""
        return self.depth + 1

    def grow(self, expander: Expander, root: int, root_hidden: torch.Tensor) -> DraftTree:
        return grow_dynamic(expander, root, root_hidden, self.top_k, self.depth, self.total_tokens,
                            self.min_prob or 0.0)

    def beside(self, context_nodes: int) -> DynamicTree | None:
        """The head's share of the round when the context's chains take `context_nodes` of its total_tokens - 1
        drafts: the rest, or None when they take it all (a long match's chain may exceed the budget: that round is
        the context's alone, and the head's drafting time is saved). Chosen by measurement (docs/decoding.md,
        "Drafting from the context")."""
        left = self.total_tokens - context_nodes
        return replace(self, total_tokens=left) if left >= 2 else None


@dataclass(frozen=True)
class StaticTree:
    """EAGLE-1's fixed tree: each path lists child ranks from the root (0 = the head's top-1 draft)."""

    paths: tuple[tuple[int, ...], ...] = tuple(map(tuple, MC_SIM_7B_63))

    def __post_init__(self):
        paths = tuple(tuple(int(rank) for rank in path) for path in self.paths)
        if not paths or any(not path or min(path) < 0 for path in paths):
            raise ValueError("a static tree needs at least one path, each a non-empty list of ranks >= 0")
        object.__setattr__(self, "paths", paths)

    @property
    def max_levels(self) -> int:
        return max(map(len, self.paths))

    def grow(self, expander: Expander, root: int, root_hidden: torch.Tensor) -> DraftTree:
        return grow_static(expander, root, root_hidden, [list(p) for p in self.paths])

    def beside(self, context_nodes: int) -> StaticTree:
        """A fixed shape has no budget to share: the context's chains are grafted on top of it."""
        return self


def graft(tree: DraftTree, chains: list[list[int]]) -> DraftTree:
    """The tree with token chains added under its root. A chain follows the tree's nodes while their tokens agree
    and continues with new nodes, marked from_context, where they part: siblings never repeat a token, and new
    nodes come after the old ones, so parents still precede children."""
    if not chains:  # most rounds with context drafting off or no match: the tree as it is, not rebuilt
        return tree
    tokens, parents, from_context = tree.tokens.tolist(), tree.parents.tolist(), tree.from_context.tolist()
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens)) if node > 0}
    for chain in chains:
        node = 0
        for token in chain:
            if (node, token) not in child:
                child[node, token] = len(tokens)
                tokens.append(token)
                parents.append(node)
                from_context.append(True)
            node = child[node, token]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(from_context))


TreeSpec = Union[DynamicTree, StaticTree]
TREES = {"dynamic": DynamicTree, "static": StaticTree}
