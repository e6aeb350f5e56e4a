"""Draft tree shapes: EAGLE-1's static tree and EAGLE-2's dynamic tree, with ancestor masks and depths."""
import torch

from conftest import tiny_engine
from engine.draft.drafter import Drafter
from engine.tree import DraftTree, DynamicTree, StaticTree


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


def _drafter(kind, prompt):
    engine = tiny_engine("llama-h64-l8-gqa", kind)
    hidden, features = engine.target.forward(torch.tensor(prompt), engine.target.new_cache())
    drafter = Drafter(engine.head)
    drafter.commit(features, torch.tensor(prompt[1:] + [7]))
    return drafter


def test_static_tree_has_the_published_shape(prompt):
    tree = _drafter("eagle1", prompt).propose(7, StaticTree())
    assert len(tree) == 26  # 25 drafted nodes + root
    assert tree.depths.max() == 5
    assert sum(1 for kids in tree.children() if not kids) == 15  # leaves, as in the official buffers
    _check_tree(tree)


def test_dynamic_tree_size_and_ranking(prompt):
    drafter = _drafter("eagle3", prompt)
    for total, depth, k in [(10, 3, 4), (24, 5, 8), (60, 7, 10)]:
        tree = drafter.propose(7, DynamicTree(total, depth, k))
        assert len(tree) == min(total, 1 + k + depth * k * k)
        assert tree.depths.max() <= depth + 1
        assert tree.tokens[0] == 7
        _check_tree(tree)
        for kids in tree.children():  # siblings come from one top-k: never the same token twice
            toks = tree.tokens[kids].tolist()
            assert len(toks) == len(set(toks))
