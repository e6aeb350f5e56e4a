"""Sampling draws exactly from the target distribution, checked against the independent reference in oracles.py
(itself checked against transformers' warpers): exact laws of whole rounds through draft trees whose children hold
most of the mass, and every token of end-to-end generations, each judged by a chi-square test whose false-alarm
rate is oracles.ALPHA."""
import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import BRANCHING, Alternating, tiny_engine, tokens_of
from engine.decode.params import DecodeParams
from engine.draft.tree import DraftTree
from engine.decode.accept import Sampling, accept_sampling
from oracles import ALPHA, chi_square_pvalue, randomized_pit, round_distribution, target_probs, uniformity_pvalue

V = 8
DRAWS = 2000
SETTINGS = [Sampling(1.0), Sampling(0.7, top_p=0.8), Sampling(1.3, top_k=3), Sampling(0.9, top_p=0.9, top_k=4)]


def _name(s: Sampling) -> str:
    return f"T{s.temperature}-p{s.top_p}-k{s.top_k}"


def _random_settings(count: int, seed: int):
    """Logits of varied vocabularies and sharpness, with temperature, top-k and top-p in every combination."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        vocab = int(torch.randint(2, 40, (1,), generator=g))
        logits = torch.randn(vocab, generator=g) * float(0.2 + 4 * torch.rand(1, generator=g))
        temperature = float(0.2 + 2 * torch.rand(1, generator=g))
        top_k = int(torch.randint(0, vocab + 2, (1,), generator=g))
        top_p = float(min(1.0, 0.05 + 1.1 * torch.rand(1, generator=g)))
        yield logits, temperature, top_k, top_p


def test_reference_distribution_matches_transformers_warpers():
    """The oracle is only as good as its agreement with the definition: transformers' own warpers, in its order."""
    for logits, temperature, top_k, top_p in _random_settings(400, seed=0):
        warpers = [TemperatureLogitsWarper(temperature)]
        warpers += [TopKLogitsWarper(top_k)] if top_k else []
        warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
        expected = torch.softmax(LogitsProcessorList(warpers)(None, logits[None].clone())[0], dim=-1)
        reference = torch.tensor(target_probs(logits.tolist(), temperature, top_k, top_p), dtype=torch.float32)
        assert torch.allclose(reference, expected, atol=1e-6), (temperature, top_k, top_p)


def test_sampling_probs_match_the_reference():
    for logits, temperature, top_k, top_p in _random_settings(400, seed=1):
        probs = Sampling(temperature, top_p=top_p, top_k=top_k).probs(logits)
        reference = torch.tensor(target_probs(logits.tolist(), temperature, top_k, top_p), dtype=torch.float32)
        assert torch.allclose(probs, reference, atol=1e-6), (temperature, top_k, top_p)


def _node_logits(nodes: int, seed: int) -> torch.Tensor:
    return torch.randn(nodes, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _ranked(row: torch.Tensor) -> list[int]:
    return torch.argsort(row, descending=True).tolist()


def _likeliest_tree(logits: torch.Tensor) -> DraftTree:
    """Each node drafts the target's likeliest tokens, in order, so the drafted children hold most of the mass and
    every rejection's renormalisation shapes what follows: root -> top 3; its first child -> top 2; then chains."""
    r = [_ranked(row) for row in logits]
    tokens = [0, r[0][0], r[0][1], r[0][2], r[1][0], r[1][1], r[2][0], r[4][0]]
    return DraftTree(torch.tensor(tokens), torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4]))


def _adversarial_tree(logits: torch.Tensor) -> DraftTree:
    """The root's likely tokens drafted in reverse order after its least likely one (outside any top-k), one of them
    twice, with children under the duplicate's first copy and under the likeliest, those again in odd order."""
    r = [_ranked(row) for row in logits]
    tokens = [0, r[0][-1], r[0][2], r[0][1], r[0][2], r[0][0], r[2][1], r[2][0], r[5][-1], r[5][1]]
    return DraftTree(torch.tensor(tokens), torch.tensor([-1, 0, 0, 0, 0, 0, 2, 2, 5, 5]))


def _round_outcomes(tree: DraftTree, logits: torch.Tensor, sampling: Sampling, draws: int, seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    outcomes = []
    for _ in range(draws):
        path, bonus = accept_sampling(tree, logits, sampling, gen)
        outcomes.append(tuple(tree.tokens[path[1:]].tolist()) + (bonus,))
    return outcomes


def _exact_law(tree: DraftTree, logits: torch.Tensor, sampling: Sampling) -> dict:
    s = sampling
    probs = [target_probs(row.tolist(), s.temperature, s.top_k, s.top_p) for row in logits]
    return round_distribution(tree.tokens.tolist(), tree.parents.tolist(), probs)


@pytest.mark.parametrize("build", [_likeliest_tree, _adversarial_tree], ids=["likeliest", "adversarial"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=_name)
def test_a_round_commits_token_sequences_with_their_exact_probability(build, sampling):
    """The whole round's output (accepted drafts + bonus), not only its first token, against its exact law."""
    logits = _node_logits(10, seed=0)
    tree = build(logits)
    law = _exact_law(tree, logits, sampling)
    assert sum(p for seq, p in law.items() if len(seq) > 1) > 0.3, "drafts must carry mass for the test to bite"
    outcomes = _round_outcomes(tree, logits, sampling, DRAWS, seed=1)
    assert chi_square_pvalue(outcomes, law) > ALPHA


@pytest.mark.parametrize("sampling", [Sampling(1.0, top_k=3), Sampling(1.0, top_p=0.5)], ids=_name)
def test_tokens_outside_top_k_and_top_p_are_never_committed(sampling):
    """A tree drafting only tokens the target excludes: none may be accepted, and no bonus may fall outside."""
    logits = _node_logits(4, seed=2)
    support = [{t for t, p in enumerate(target_probs(row.tolist(), 1.0, sampling.top_k, sampling.top_p)) if p > 0}
               for row in logits]
    outside = [t for t in _ranked(logits[0]) if t not in support[0]]
    assert len(outside) >= 3
    tree = DraftTree(torch.tensor([0] + outside[:3]), torch.tensor([-1, 0, 0, 0]))
    for tokens in _round_outcomes(tree, logits, sampling, 500, seed=3):
        assert tokens[0] in support[0], tokens


@pytest.mark.parametrize("gate", [False, True])
def test_engine_samples_every_token_from_the_target_law(gate, prompt):
    """End to end with a random head: each generated token's randomized probability integral transform against the
    target law (one plain forward over prompt and answer, then the reference warpers) must be uniform. gate: the
    head drafts in every other window of 3 rounds (engine/decode/gate.py), deferring its slots in between; a seed would turn
    the gate off (DecodeParams.gated), so those answers draw from torch's own generator, seeded here."""
    engine, sampling = tiny_engine("llama-h64-l8-gqa", "eagle3"), Sampling(0.8, top_p=0.95)
    engine.gate = Alternating(window=3)
    u, pits, accepted = torch.Generator().manual_seed(0), [], 0
    for seed in range(30):
        torch.manual_seed(seed)
        params = DecodeParams(max_new_tokens=16, sampling=sampling, seed=None if gate else seed, gate=gate)
        params = params.with_options(**BRANCHING)
        assert params.gated == gate
        steps = list(engine.generate(prompt, params))
        accepted += sum(s.accepted for s in steps)
        tokens = tokens_of(steps)
        with torch.inference_mode():
            logits = engine.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
        for token, row in zip(tokens, logits):
            probs = target_probs(row.tolist(), sampling.temperature, sampling.top_k, sampling.top_p)
            assert probs[token] > 0, "a token outside the top-p nucleus was committed"
            pits.append(randomized_pit(token, probs, float(torch.rand((), generator=u))))
    assert accepted >= (30 if gate else 60), f"only {accepted} drafts accepted: sampled acceptance went untested"
    assert uniformity_pvalue(pits) > ALPHA
