"""Draft trees: ancestor masks and depths, and which nodes a tree holds. A fake head whose outputs are a known
function of the token path it read lets EAGLE-2's ranking, parents and cumulative scores and EAGLE-1's static
ranks be checked against brute force (oracles.py), along with what every fed node sees and the level it is fed
at; the real heads' trees are checked against the head run one token at a time along each node's path."""
import math
import zlib

import pytest
import torch

from conftest import tiny_engine
from engine.draft.drafter import Drafter
from engine.draft.tree import MC_SIM_7B_63, DraftTree, DynamicTree, StaticTree, grow_dynamic, grow_static
from oracles import dynamic_tree_reference, node_paths, static_tree_reference

ROOT = 7  # the token every test tree grows under

def _check_tree(tree: DraftTree):
    parents = tree.parents.tolist()
    assert parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(parents) if i > 0), "parents must precede children"
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        expected = {i}
        p = parents[i]
        while p >= 0:
            expected.add(p)
            p = parents[p]
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == expected
        assert tree.depths[i] == len(expected) - 1


def test_ancestor_mask_and_depths_by_hand():
    tree = DraftTree(tokens=torch.tensor([5, 1, 2, 3, 4]), parents=torch.tensor([-1, 0, 0, 1, 3]))
    assert tree.depths.tolist() == [0, 1, 1, 2, 3]
    assert tree.children() == [[1, 2], [3], [], [4], []]
    _check_tree(tree)


def _drafter(engine, prompt):
    hidden, features = engine.target.forward(torch.tensor(prompt), engine.target.new_cache())
    drafter = Drafter(engine.head)
    drafter.commit(features, torch.tensor(prompt[1:] + [ROOT]))
    return drafter


def test_static_tree_has_the_published_shape(prompt):
    tree = _drafter(tiny_engine("llama-h64-l8-gqa", "eagle1"), prompt).propose(ROOT, StaticTree())
    assert len(tree) == 26  # 25 drafted nodes + root
    assert tree.depths.max() == 5
    assert sum(1 for kids in tree.children() if not kids) == 15  # leaves, as in the official buffers
    _check_tree(tree)


def test_dynamic_tree_size(prompt):
    drafter = _drafter(tiny_engine("llama-h64-l8-gqa", "eagle3"), prompt)
    for total, depth, k in [(10, 3, 4), (24, 5, 8), (60, 7, 10)]:
        tree = drafter.propose(ROOT, DynamicTree(total, depth, k))
        assert len(tree) == min(total, 1 + k + depth * k * k)
        assert tree.depths.max() <= depth + 1
        assert tree.tokens[0] == ROOT
        _check_tree(tree)
        for kids in tree.children():  # siblings come from one top-k: never the same token twice
            toks = tree.tokens[kids].tolist()
            assert len(toks) == len(set(toks))


def _head_output_after(engine, prompt: list[int], path: list[int]) -> torch.Tensor:
    """The head's output after the prompt and `path` (the root first), fed straight through the head module one
    token at a time with plain causal visibility: what the tree's batched feeding must compute for that node."""
    head, n = engine.head, len(prompt)
    _, features = engine.target.forward(torch.tensor(prompt), engine.target.new_cache())
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    out, past = head(features[None], torch.tensor([prompt[1:] + path[:1]]), torch.arange(n), None, causal,
                     from_target=True)
    hidden = out[0, -1]
    for i, token in enumerate(path[1:]):
        visible = torch.ones(1, 1, 1, n + i + 1, dtype=torch.bool)
        out, kv = head(hidden[None, None], torch.tensor([[token]]), torch.tensor([n + i]), past, visible,
                       from_target=False)
        past = [(torch.cat([k, k1], 2), torch.cat([v, v1], 2)) for (k, v), (k1, v1) in zip(past, kv)]
        hidden = out[0, -1]
    return hidden


def _recording(expand, fed: list):
    """Wrap a drafter's expand to keep (token path, head output) of every node the tree feeds, the path read off
    the node's visible row: the fed nodes it sees, in feeding order, are its ancestors."""

    def recorded(hidden: torch.Tensor, tokens: torch.Tensor, level: int, visible: torch.Tensor) -> torch.Tensor:
        out, before = expand(hidden, tokens, level, visible), len(fed)
        for i, token in enumerate(tokens.tolist()):
            seen = visible[i, :before].nonzero().flatten().tolist()
            fed.append(((fed[seen[-1]][0] if seen else ()) + (token,), out[i]))
        return out

    return recorded


@pytest.mark.parametrize("kind,spec", [("eagle3", DynamicTree(total_tokens=24, depth=4, top_k=4)),
                                       ("eagle1", StaticTree())], ids=["eagle3-dynamic", "eagle1-static"])
def test_real_heads_draft_as_one_token_at_a_time_would(kind, spec, prompt, monkeypatch):
    """The tree's batched feeding (positions, masks, hidden states, the tree's own keys) gives every node the
    head's output for its path fed alone, and each node's children are the likeliest drafts after it, in order."""
    engine = tiny_engine("llama-h64-l8-gqa", kind)
    drafter, fed = _drafter(engine, prompt), []
    monkeypatch.setattr(drafter, "expand", _recording(drafter.expand, fed))
    tree = drafter.propose(ROOT, spec)
    assert len(fed) > 3
    for path, out in fed:  # random heads' outputs are large (EAGLE-1's ~1e6 here): compare relative to their scale
        alone = _head_output_after(engine, prompt, [ROOT, *path])
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item(),
                                   msg=lambda m: f"node {path}: {m}")
    paths = node_paths(tree.tokens.tolist(), tree.parents.tolist())
    for node, kids in enumerate(tree.children()):
        if kids:
            ranked = engine.head.logits(_head_output_after(engine, prompt, [ROOT, *paths[node]])).topk(len(kids))
            assert tree.tokens[kids].tolist() == engine.head.to_target(ranked.indices).tolist(), f"node {node}"


# The fake head's sizes: a draft vocabulary mapped into a larger base one, and the longest path it can encode.
VOCAB, DRAFT_VOCAB, MAX_PATH = 50, 20, 12


class PathHead:
    """An Expander whose hidden state is the token path read so far (token + 1 per slot, 0 = empty) and whose
    draft log-probs after a path are seeded by it. expand() checks that each new node sees exactly the fed nodes
    of its path, in order, and itself, at level len(path) - 1: a mis-wired tree makes it raise."""

    def __init__(self, seed: int):
        self.seed = seed
        self.draft_to_target = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB]
        self.fed: list[tuple[int, ...]] = []

    @staticmethod
    def encode(path: tuple[int, ...]) -> torch.Tensor:
        hidden = torch.zeros(MAX_PATH)
        hidden[: len(path)] = torch.tensor(path, dtype=torch.float32) + 1
        return hidden

    @staticmethod
    def decode(hidden: torch.Tensor) -> tuple[int, ...]:
        return tuple(int(x) - 1 for x in hidden.tolist() if x > 0)

    def path_log_probs(self, path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, path)).encode()))
        return torch.log_softmax(torch.randn(DRAFT_VOCAB, generator=g) * 3, dim=-1)

    def expand(self, hidden: torch.Tensor, tokens: torch.Tensor, level: int, visible: torch.Tensor) -> torch.Tensor:
        before = len(self.fed)
        assert visible.shape == (len(tokens), before + len(tokens)), "visible must cover every fed node"
        new = [self.decode(h) + (int(t),) for h, t in zip(hidden, tokens)]
        for i, path in enumerate(new):
            seen = [self.fed[j] for j in visible[i, :before].nonzero().flatten().tolist()]
            assert seen == [path[:d] for d in range(1, len(path))], f"{path} sees {seen}, not its ancestors"
            assert visible[i, before:].nonzero().flatten().tolist() == [i], f"{path} must see itself, no sibling"
            assert level == len(path) - 1, f"{path} fed at level {level}"
        self.fed += new
        return torch.stack([self.encode(p) for p in new])

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.path_log_probs(self.decode(h)) for h in hidden])

    def root_log_probs(self, root_hidden: torch.Tensor) -> torch.Tensor:
        return self.log_probs(root_hidden[None])[0]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_ids]

    def reference_log_probs(self, path: tuple[int, ...]) -> list[float]:
        return self.path_log_probs(path).double().tolist()

    def reference_to_target(self, draft_id: int) -> int:
        return int(self.draft_to_target[draft_id])


@pytest.mark.parametrize("top_k,depth,total_tokens",
                         [(1, 1, 2), (3, 2, 2), (3, 2, 6), (4, 3, 10), (8, 5, 30), (5, 6, 200), (2, 7, 12), (3, 4, 4)])
def test_dynamic_tree_is_eagle2s_best_scored_nodes(top_k, depth, total_tokens):
    for seed in range(3):
        head = PathHead(seed)
        tree = grow_dynamic(head, ROOT, PathHead.encode(()), top_k, depth, total_tokens)
        expected = dynamic_tree_reference(head.reference_log_probs, head.reference_to_target, top_k, depth,
                                          total_tokens)
        assert tree.tokens[0] == ROOT and tree.parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(tree.parents.tolist()) if i), "parents must precede children"
        paths = node_paths(tree.tokens.tolist(), tree.parents.tolist())[1:]
        assert len(paths) == len(expected) == min(total_tokens - 1, top_k + depth * top_k * top_k)
        assert set(paths) == set(expected), "the tree must hold exactly the best-scored candidates"
        assert tree.depths[1:].tolist() == [len(p) for p in paths]
        _assert_siblings_in_rank_order(head, tree)
        # A node of depth d ranks behind its d - 1 ancestors: levels deeper than the kept count are not fed.
        assert max(map(len, head.fed), default=0) == min(depth, total_tokens - 2)


@pytest.mark.parametrize("min_prob", [0.01, 0.05, 0.2, 0.6, 0.95])
@pytest.mark.parametrize("top_k,depth,total_tokens", [(3, 4, 12), (3, 2, 2)])
def test_min_prob_keeps_the_confident_best_nodes_and_grows_no_level_below_it(min_prob, top_k, depth, total_tokens):
    grown = min(depth, total_tokens - 2)
    for seed in range(4):
        head = PathHead(seed)
        tree = grow_dynamic(head, ROOT, PathHead.encode(()), top_k, depth, total_tokens, min_prob)
        _check_tree(tree)
        best = dynamic_tree_reference(head.reference_log_probs, head.reference_to_target, top_k, depth, total_tokens)
        floor = math.log(min_prob)
        paths = node_paths(tree.tokens.tolist(), tree.parents.tolist())[1:]
        assert sorted(paths) == sorted(p for p, score in best.items() if score >= floor)
        # A level is fed only when some node of its beam reaches min_prob: else none of its children could.
        met = dynamic_tree_reference(head.reference_log_probs, head.reference_to_target, top_k, depth, 10**6)
        worth = max((len(p) for p, score in met.items() if score >= floor and len(p) <= grown), default=0)
        assert max(map(len, head.fed), default=0) == worth


def test_min_prob_out_of_range_is_refused():
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="min_prob"):
            DynamicTree(min_prob=bad)


def _assert_siblings_in_rank_order(head: PathHead, tree) -> None:
    """Sampling tries children in node order: it must be the draft's rank order under their parent."""
    paths = node_paths(tree.tokens.tolist(), tree.parents.tolist())
    target_to_draft = {int(t): d for d, t in enumerate(head.draft_to_target.tolist())}
    for node, kids in enumerate(tree.children()):
        lp = head.reference_log_probs(paths[node])
        scores = [lp[target_to_draft[int(tree.tokens[k])]] for k in kids]
        assert scores == sorted(scores, reverse=True), f"children of node {node} out of rank order"


@pytest.mark.parametrize("paths", [MC_SIM_7B_63, [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2], [0, 0, 0, 3]]],
                         ids=["mc_sim_7b_63", "custom"])
def test_static_tree_nodes_hold_the_ranked_drafts(paths):
    for seed in range(3):
        head = PathHead(seed)
        tree = grow_static(head, ROOT, PathHead.encode(()), paths)
        expected = static_tree_reference(head.reference_log_probs, head.reference_to_target, paths)
        got = node_paths(tree.tokens.tolist(), tree.parents.tolist())[1:]
        assert sorted(got) == sorted(expected.values())
        _assert_siblings_in_rank_order(head, tree)
