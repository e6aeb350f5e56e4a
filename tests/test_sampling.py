"""Tree speculative sampling must reproduce the target distribution exactly (statistically tested)."""
import pytest
import torch

from conftest import tiny_engine, tokens_of
from engine.tree import DraftTree
from engine.verify import Sampling, accept_sampling

V = 6
SETTINGS = [Sampling(1.0), Sampling(0.7, top_p=0.8), Sampling(1.3, top_k=3), Sampling(0.9, top_p=0.9, top_k=4)]


def _tree_and_logits(seed: int):
    # root with three children (tokens 0, 1, 2); child 1 has two children (tokens 3, 0).
    tree = DraftTree(tokens=torch.tensor([5, 0, 1, 2, 3, 0]), parents=torch.tensor([-1, 0, 0, 0, 2, 2]))
    logits = torch.randn(len(tree), V, generator=torch.Generator().manual_seed(seed)) * 1.5
    logits[0, 1] += 3.0  # node 2's token is the target's favourite, so its subtree is reached often
    return tree, logits


def _empirical(tree, logits, sampling, draws, seed):
    gen = torch.Generator().manual_seed(seed)
    first = torch.zeros(V)
    second_after_1 = torch.zeros(V)
    for _ in range(draws):
        path, bonus = accept_sampling(tree, logits, sampling, gen)
        tokens = tree.tokens[path[1:]].tolist() + [bonus]
        first[tokens[0]] += 1
        if len(path) > 1 and path[1] == 2:  # first token came from node 2 (token 1): its continuation
            second_after_1[tokens[1]] += 1
    return first / first.sum(), second_after_1 / second_after_1.sum()


def _tv(p, q):
    return 0.5 * (p - q).abs().sum().item()


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_tree_sampling_matches_target_distribution(sampling):
    tree, logits = _tree_and_logits(seed=0)
    target_first = sampling.probs(logits[0])
    target_second = sampling.probs(logits[2])
    # The TV distance of an n-draw empirical distribution shrinks like 1/sqrt(n): averaged over 8 runs of 250
    # draws it must be clearly larger than for one run of 8000, and the latter must be small.
    small = sum(_tv(_empirical(tree, logits, sampling, 250, seed=s)[0], target_first) for s in range(8)) / 8
    first, second = _empirical(tree, logits, sampling, 8000, seed=99)
    large = _tv(first, target_first)
    assert large < small
    assert large < 0.03
    assert _tv(second, target_second) < 0.05


def test_sampling_respects_top_k_and_top_p_support():
    tree, logits = _tree_and_logits(seed=1)
    sampling = Sampling(1.0, top_k=2)
    allowed = set(torch.topk(logits[0], 2).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        path, bonus = accept_sampling(tree, logits, sampling, gen)
        assert (tree.tokens[path[1]].item() if len(path) > 1 else bonus) in allowed


def test_engine_sampling_matches_vanilla_distribution(prompt):
    """End to end: the second generated token's distribution is the same for eagle and vanilla sampling."""
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    params = dict(temperature=0.8, top_p=0.95, max_new_tokens=2)
    counts = {m: torch.zeros(16) for m in ("vanilla", "eagle")}
    firsts = {}
    for seed in range(400):
        for method in counts:
            toks = tokens_of(engine.generate(prompt, method=method, seed=seed, **params))
            if method == "vanilla":
                firsts[seed] = toks[0]
            assert toks[0] == firsts[seed], "the first token comes from prefill with the same seed"
            counts[method][toks[1]] += 1
    # Both estimate the same mixture over first tokens; compare them with the exact target mixture.
    model = engine.model
    exact = torch.zeros(16)
    sampling = Sampling(0.8, top_p=0.95)
    for first, n in zip(*torch.unique(torch.tensor(list(firsts.values())), return_counts=True)):
        logits = model(torch.tensor([prompt + [first.item()]])).logits[0, -1]
        exact += n * sampling.probs(logits)
    exact /= exact.sum()
    for method, c in counts.items():
        assert _tv(c / c.sum(), exact) < 0.12, method
