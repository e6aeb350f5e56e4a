"""The corpus index against a brute-force search of its replies, its cache on disk, and decoding that drafts from
it: greedy output is plain decoding's, sampled output follows the target law."""
import random
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import IdsOnlyTokenizer, sample_through_copied_drafts, tiny_base, tiny_engine, tokens_of
from engine import DecodeParams, Engine
from engine.draft import corpus as corpus_module
from engine.draft.context import ContextDraft
from engine.draft.corpus import DEPTH, VOTERS, CorpusIndex
from engine.options import parse_corpus
from engine.draft.records import save_records
from engine.decode.accept import Sampling
from oracles import ALPHA, drafted_frequency_pvalue, uniformity_pvalue

END = -1  # what brute force reads past a reply's last token


def occurrences(replies: list[list[int]], text: list[int], length: int) -> list[tuple[int, int]]:
    """(reply, position after it) of every occurrence of text's last `length` tokens."""
    tail = text[len(text) - length:]
    return [(r, end) for r, reply in enumerate(replies) for end in range(length, len(reply) + 1)
            if reply[end - length: end] == tail]


def longest_match(replies: list[list[int]], text: list[int]) -> int:
    return max((n for n in range(1, min(DEPTH, len(text)) + 1) if occurrences(replies, text, n)), default=0)


def random_replies(rng: random.Random, vocab: int) -> list[list[int]]:
    """A few short replies with stretches copied from earlier ones, as a model repeats its phrases."""
    replies, total = [], 0
    while total < 150:
        reply: list[int] = []
        for _ in range(rng.randint(1, 20)):
            if replies and rng.random() < 0.3:
                source = rng.choice(replies)
                start = rng.randrange(len(source))
                reply += source[start: start + rng.randint(1, 8)]
            else:
                reply.append(rng.randrange(vocab))
        replies.append(reply)
        total += len(reply)
    return replies


def query(rng: random.Random, replies: list[list[int]], vocab: int) -> list[int]:
    """A text whose end often occurs in the replies: random tokens, then part of a reply."""
    source = rng.choice(replies)
    cut = rng.randint(0, len(source))
    return [rng.randrange(vocab) for _ in range(rng.randint(0, 5))] + source[rng.randint(0, cut): cut]


@pytest.mark.parametrize("vocab", [2, 3, 6, 40])
def test_matches_and_continuations_agree_with_brute_force(vocab):
    rng = random.Random(vocab)
    for trial in range(6):
        replies = random_replies(rng, vocab)
        index = CorpusIndex(replies, cache=False)
        for _ in range(40):
            text = query(rng, replies, vocab)
            match = index.match(text)
            assert match.length == longest_match(replies, text), (replies, text)
            if not match.length:
                assert index.continuation(match, 3) == []
                continue
            found = occurrences(replies, text, match.length)
            assert match.hi - match.lo == len(found) < VOTERS
            share, max_tokens = rng.choice([0.0, 0.5, 0.8]), rng.randint(1, 6)
            chain = index.continuation(match, max_tokens, share)
            voters = [(replies[r], end) for r, end in found]
            for token in chain:  # each token is the majority among the occurrences that agreed so far
                votes = Counter(reply[end] if end < len(reply) else END for reply, end in voters)
                assert token != END and votes[token] == max(votes.values()) and votes[token] >= share * len(voters)
                voters = [(reply, end + 1) for reply, end in voters if end < len(reply) and reply[end] == token]
            if voters and len(chain) < max_tokens:  # and it stopped where the replies end or disagree
                votes = Counter(reply[end] if end < len(reply) else END for reply, end in voters)
                assert votes[END] == max(votes.values()) or max(votes.values()) < share * len(voters)


def test_matches_stay_within_one_reply_and_within_the_depth():
    index = CorpusIndex([[1, 2], [3, 4, 5], list(range(10, 50))], cache=False)
    assert index.match([2, 3]).length == 1  # "2 3" spans two replies: only "3" occurs
    assert index.continuation(index.match([2, 3]), 5) == [4, 5]  # and the copy ends with its reply
    assert index.continuation(index.match([7, 1, 2]), 5) == []
    assert index.match(list(range(10, 48))).length == DEPTH
    assert index.continuation(index.match(list(range(10, 48))), 3) == [48, 49]
    assert index.match([]).length == index.match([99]).length == 0
    assert index.continuation(index.match([99]), 3) == []
    with pytest.raises(ValueError, match="non-negative"):
        CorpusIndex([[1, -2]], cache=False)


def test_a_split_vote_drafts_only_what_enough_replies_agree_on():
    index = CorpusIndex([[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5]], cache=False)
    after_1 = index.match([1])
    assert index.continuation(after_1, 3) == [2, 3]
    assert index.continuation(after_1, 3, min_share=0.7) == [2]  # 3 of 4 say 2, then 2 of 3 say 3
    assert index.continuation(after_1, 3, min_share=0.8) == []


def test_replies_come_from_record_files_without_their_prompts(tmp_path):
    path = tmp_path / "data.npz"
    save_records([{"id": "a", "input_ids": [7, 7, 1, 2, 3], "prompt_len": 2},
                  {"id": "b", "input_ids": [8, 1, 2, 9], "prompt_len": 1}], path)
    index = CorpusIndex.from_files([path], cache=False)
    assert index.stream.tolist() == [1, 2, 3, -1, 1, 2, 9, -2]
    assert index.match([0, 7]).length == 0  # prompt tokens are not in it
    with pytest.raises(ValueError, match="empty"):
        CorpusIndex.from_files([], cache=False)


def test_the_sorted_index_is_kept_on_disk_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path))
    replies = random_replies(random.Random(0), 5)
    first = CorpusIndex(replies)
    [kept] = (tmp_path / "corpus").glob("*.npy")
    assert np.array_equal(np.load(kept), first.ends)

    def no_build(stream):
        raise AssertionError("rebuilt although the cache holds it")

    with monkeypatch.context() as patch:
        patch.setattr(corpus_module, "_sorted_ends", no_build)
        assert np.array_equal(CorpusIndex(replies).ends, first.ends)
    kept.write_bytes(b"not an array")
    assert np.array_equal(CorpusIndex(replies).ends, first.ends)
    np.save(kept, first.ends[::-1].copy() + len(first.ends))  # readable, but out of range
    assert np.array_equal(CorpusIndex(replies).ends, first.ends)
    assert np.array_equal(np.load(kept), first.ends)


def test_an_unwritable_cache_still_gives_the_index(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(blocker))
    replies = random_replies(random.Random(1), 5)
    assert np.array_equal(CorpusIndex(replies).ends, CorpusIndex(replies, cache=False).ends)
    assert "could not keep the corpus index" in caplog.text


def test_corpus_options_and_a_corpus_for_another_vocabulary():
    assert parse_corpus(["default"]) == "default" and parse_corpus(["none"]) is None
    assert parse_corpus(["a.npz", "b.npz"]) == ("a.npz", "b.npz")
    with pytest.raises(ValueError, match="not a mix"):
        parse_corpus(["default", "a.npz"])
    model = tiny_base("qwen2-h32-l10-tied")
    with pytest.raises(ValueError, match="tokenized for another model"):
        Engine.over(model, IdsOnlyTokenizer(), corpus=CorpusIndex([[1, model.config.vocab_size]], cache=False))
    with pytest.raises(ValueError, match="corpus_share"):
        ContextDraft(corpus_share=1.5)


CORPUS_ONLY = ContextDraft(min_match=10**6, corpus_share=0.0, corpus_max_tokens=4)  # the context never drafts
NEW_TOKENS = 60


def own_replies(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [tokens_of(engine.generate(p, method="vanilla", max_new_tokens=NEW_TOKENS)) for p in prompts]


@pytest.mark.parametrize("shape", ["llama-h48-l7-mqa", "qwen2-h32-l10-tied"])
@pytest.mark.parametrize("method,kind", [("suffix", None), ("eagle", "eagle3")])
def test_greedy_drafting_from_the_corpus_is_plain_decoding(shape, method, kind, prompt):
    engine = tiny_engine(shape, kind)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
    others = own_replies(engine, [[t] for t in range(8)])
    generator = torch.Generator().manual_seed(5)
    for replies in (others + [vanilla], [torch.randint(0, 16, (30,), generator=generator).tolist()] * 3):
        engine.corpus = CorpusIndex(replies, cache=False)
        for context in (CORPUS_ONLY, ContextDraft()):
            steps = list(engine.generate(prompt, method=method, max_new_tokens=NEW_TOKENS, context=context))
            assert tokens_of(steps) == vanilla, (method, context)
    engine.corpus = CorpusIndex(others + [vanilla], cache=False)
    drafted = list(engine.generate(prompt, method=method, max_new_tokens=NEW_TOKENS, context=CORPUS_ONLY))
    off = list(engine.generate(prompt, method=method, max_new_tokens=NEW_TOKENS, context=CORPUS_ONLY, corpus=False))
    assert sum(sum(s.from_context) for s in drafted) >= NEW_TOKENS // 2  # it knew this answer
    assert sum(sum(s.from_context) for s in off) == 0


@pytest.mark.parametrize("method", ["eagle", "suffix"])
def test_sampling_through_corpus_chains_draws_the_target_law(method):
    """Every sampled token passes the randomized probability integral transform against the target law, with many
    of them accepted from the corpus's chains (q = 1, as the context's)."""
    engine = tiny_engine("llama-h48-l7-mqa", "eagle3")
    sampling = Sampling(0.6)
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]
    engine.corpus = CorpusIndex([tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=24,
                                                           temperature=sampling.temperature, seed=100 + s))
                                 for s in range(20)], cache=False)
    sample = sample_through_copied_drafts(engine, prompt, lambda seed: DecodeParams(
        method=method, max_new_tokens=24, sampling=sampling, seed=seed, context=CORPUS_ONLY))
    assert sample.copied >= 60, f"only {sample.copied} sampled tokens came from the corpus's chains"
    assert drafted_frequency_pvalue(sample.drafts) > ALPHA
    assert uniformity_pvalue(sample.pits) > ALPHA
