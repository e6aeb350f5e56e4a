"""The context index against a brute-force search of the text, on random and repetitive token strings."""
import random

import pytest
import torch

from engine.draft.context import Continuation, ContextIndex


def brute_force(text: list[int], max_tokens: int, max_branches: int) -> list[Continuation]:
    """Longest suffix of `text` that also ends earlier; per next token, its count and latest occurrence."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        suffix = text[n - length:]
        ends = [e for e in range(length - 1, n - 1) if text[e - length + 1: e + 1] == suffix]
        if ends:
            break
    else:
        return []
    latest: dict[int, int] = {}
    count: dict[int, int] = {}
    for e in ends:
        follower = text[e + 1]
        count[follower] = count.get(follower, 0) + 1
        latest[follower] = e
    ranked = sorted(count, key=lambda t: (count[t], latest[t]), reverse=True)[:max_branches]
    result = []
    for follower in ranked:
        extended = list(text)
        for i in range(max_tokens):  # the text continues as it did after that occurrence
            extended.append(extended[latest[follower] + 1 + i])
        result.append(Continuation(extended[n:], length, count[follower]))
    return result


def random_text(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens with pasted-in repeats of earlier stretches, as in code edits or quoting."""
    text: list[int] = []
    while len(text) < length:
        if text and rng.random() < 0.3:
            start = rng.randrange(len(text))
            text += text[start: start + rng.randint(1, 12)]
        else:
            text.append(rng.randrange(vocab))
    return text[:length]


@pytest.mark.parametrize("vocab", [2, 3, 8, 50])
def test_every_prefix_matches_brute_force(vocab):
    rng = random.Random(vocab)
    for trial in range(30):
        text = random_text(rng, rng.randint(1, 60), vocab)
        index = ContextIndex()
        for i, token in enumerate(text):
            index.extend([token])
            max_tokens, branches = rng.randint(1, 9), rng.randint(1, 4)
            assert index.continuations(max_tokens, branches) == brute_force(text[: i + 1], max_tokens, branches), (
                text[: i + 1], max_tokens, branches)


def test_updates_in_chunks_equal_one_build():
    rng = random.Random(7)
    text = random_text(rng, 400, 5)
    chunked = ContextIndex(text[:150])
    at = 150
    while at < len(text):
        step = rng.randint(1, 6)  # a round commits a few tokens at a time
        chunked.extend(text[at: at + step])
        at += step
        assert chunked.continuations(8, 3) == brute_force(text[:at], 8, 3)
    whole = ContextIndex(text)
    assert len(chunked) == len(whole) == 400
    assert chunked.continuations(16, 5) == whole.continuations(16, 5)


def test_repeated_sentence_is_predicted_to_its_end_and_beyond():
    sentence = [11, 12, 13, 14, 15, 16, 17]
    index = ContextIndex([1, 2] + sentence + [3] + sentence[:3])
    [cont] = index.continuations(max_tokens=6)
    assert cont == Continuation([14, 15, 16, 17, 3, 11], match_length=3, count=1)
    loop = ContextIndex([5, 6, 5, 6, 5])  # copying past the text's end keeps the period
    assert loop.continuations(5)[0].tokens == [6, 5, 6, 5, 6]
    assert loop.continuations(5)[0].match_length == 3


def test_branches_rank_by_count_then_recency():
    index = ContextIndex([9, 1, 9, 2, 9, 1, 9, 3, 9])
    branches = index.continuations(max_tokens=2, max_branches=3)
    assert [(c.tokens[0], c.count) for c in branches] == [(1, 2), (3, 1), (2, 1)]
    assert all(c.match_length == 1 for c in branches)
    assert branches[0].tokens == [1, 9]  # from the latest "9 1", followed by 9


def test_no_match_gives_no_continuation():
    assert ContextIndex().continuations(4) == []
    assert ContextIndex([1, 2, 3]).continuations(4) == []


def test_accepts_tensor_ids_and_rejects_bad_input():
    index = ContextIndex(torch.tensor([4, 5, 4]))
    assert index.continuations(1) == [Continuation([5], 1, 1)]
    with pytest.raises(TypeError, match="integer ids"):
        index.extend([1.5])
    with pytest.raises(ValueError, match="non-negative"):
        index.extend([-1])
    with pytest.raises(ValueError, match="at least 1"):
        index.continuations(0)
