"""Prefixes kept across generations (engine.decode.prefixes): a chat's next turn forwards only its new tokens, and its
output is the very output a fresh prefill gives, greedy and sampled, plain and speculative, also after a stream was
closed early; an unrelated prompt starts from nothing, and an engine that is not batch-invariant keeps nothing."""
import pytest
import torch

from conftest import BRANCHING, tiny_engine, tokens_of
from engine.draft.drafter import Drafter


def _forwarded(engine, monkeypatch) -> list[int]:
    """The number of tokens each base forward of `engine` runs, in order."""
    counts, forward = [], engine.target.forward

    def counting(input_ids, *args, **kwargs):
        counts.append(len(input_ids))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.target, "forward", counting)
    return counts


@pytest.mark.parametrize("options", [dict(method="vanilla"), dict(method="eagle", **BRANCHING),
                                     dict(method="eagle", temperature=0.8, seed=5)],
                         ids=["vanilla", "eagle", "eagle-sampled"])
def test_a_next_turn_forwards_only_its_new_tokens_and_decodes_as_a_fresh_prefill(options, prompt, monkeypatch):
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3", pack=True)
    fresh = tiny_engine("llama-h64-l8-gqa", "eagle3", pack=True, reuse_prefixes=False)
    first = tokens_of(engine.generate(prompt, max_new_tokens=12, **options))
    assert first == tokens_of(fresh.generate(prompt, max_new_tokens=12, **options))
    second_prompt = prompt + first + [3, 1, 4]
    forwarded = _forwarded(engine, monkeypatch)
    second = tokens_of(engine.generate(second_prompt, max_new_tokens=12, **options))
    # The kept positions: all but the first turn's last token, whose slot in the head pairs it with the next id.
    assert forwarded[0] == len(second_prompt) - (len(prompt) + len(first) - 1)
    assert second == tokens_of(fresh.generate(second_prompt, max_new_tokens=12, **options))


def test_a_stream_closed_early_leaves_what_it_yielded(prompt, monkeypatch):
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3", pack=True)
    fresh = tiny_engine("llama-h64-l8-gqa", "eagle3", pack=True, reuse_prefixes=False)
    stream, yielded = engine.generate(prompt, max_new_tokens=30, **BRANCHING), []
    for step in stream:
        yielded += step.tokens
        if len(yielded) >= 6:
            break
    stream.close()
    follow_up = prompt + yielded + [2, 7]
    forwarded = _forwarded(engine, monkeypatch)
    assert tokens_of(engine.generate(follow_up, max_new_tokens=10, **BRANCHING)) == tokens_of(
        fresh.generate(follow_up, max_new_tokens=10, **BRANCHING))
    assert forwarded[0] == 3


def test_an_unrelated_prompt_prefills_in_full_and_the_store_keeps_the_latest(prompt, monkeypatch):
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3", pack=True)
    for shift in range(6):
        tokens_of(engine.generate([(t + shift) % 16 for t in prompt], max_new_tokens=4))
    assert len(engine.prefixes.entries) == engine.prefixes.capacity == 4
    other = [15 - t for t in prompt]
    forwarded = _forwarded(engine, monkeypatch)
    tokens_of(engine.generate(other, max_new_tokens=4))
    assert forwarded[0] == len(other)


def test_an_engine_that_is_not_batch_invariant_keeps_no_prefix(prompt):
    """Without the packed layers and the fixed-order attention a tree forward may round otherwise than a prefill,
    so a kept cache could change a token: such an engine prefills every prompt in full."""
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3", pack=False)
    assert not engine.batch_invariant and engine.prefixes is None
    assert tokens_of(engine.generate(prompt, max_new_tokens=4))


def test_a_kept_prefix_gives_the_head_the_slots_a_fresh_prefill_gives(prompt):
    """The head's slot p pairs position p's features with the next token, so a prompt that parts from the kept text
    after position c keeps only c - 1 slots: the head then holds what committing the prompt afresh builds (a slot
    kept one too far would only make drafts worse, which no greedy test sees)."""
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3", pack=True)
    first = tokens_of(engine.generate(prompt, max_new_tokens=12, **BRANCHING))
    tokens_of(engine.generate(prompt + first[:5] + [3, 1], max_new_tokens=1))  # the prefill alone
    kept = engine.prefixes.entries[-1]
    _, features = engine.target.forward(torch.tensor(kept.ids[:-1]), engine.target.new_cache())
    fresh = Drafter(engine.head)
    fresh.commit(features, torch.tensor(kept.ids[1:]))
    assert kept.head_length == fresh.length == len(kept.ids) - 1
    for layer, fresh_layer in zip(kept.head_cache, fresh.cache, strict=True):
        torch.testing.assert_close(layer.keys, fresh_layer.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.values, fresh_layer.values, rtol=1e-4, atol=1e-4)
