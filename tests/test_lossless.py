"""Greedy EAGLE output must equal plain greedy decoding token for token, for every head kind and tree."""
import threading

import pytest
import torch

from conftest import BRANCHING, SHAPES, random_head, tiny_engine, tokens_of
from engine import DecodeParams
from engine.draft.checkpoint import save_head

NEW_TOKENS = 80
MIN_PROB = 0.6  # the tiny random head's drafts fall on both sides of it


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_eagle_greedy_equals_vanilla(shape, kind, tree, prompt):
    engine = tiny_engine(shape, kind)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
    shape_options = BRANCHING if tree == "dynamic" else {}
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=NEW_TOKENS, tree=tree, **shape_options))
    assert tokens_of(steps) == vanilla
    assert sum(s.accepted for s in steps) > 0, "no draft was accepted: the test would not exercise tree paths"
    assert len(steps) < NEW_TOKENS


@pytest.mark.parametrize("shape", SHAPES)
def test_vanilla_equals_transformers_generate(shape, prompt):
    engine = tiny_engine(shape, None)
    ours = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
    ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert ours == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("total_tokens,depth,top_k", [(2, 1, 1), (8, 3, 2), (40, 6, 6), (70, 8, 10)])
def test_tree_settings_stay_lossless(total_tokens, depth, top_k, prompt):
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=60))
    eagle = engine.generate(prompt, method="eagle", max_new_tokens=60, total_tokens=total_tokens, depth=depth,
                            draft_top_k=top_k)
    assert tokens_of(eagle) == vanilla


def test_confidence_threshold_stays_lossless(prompt):
    """With min_prob some rounds keep no draft (a plain step) and others a tree: the tokens stay vanilla's."""
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=60))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=60, total_tokens=8, depth=3, draft_top_k=2,
                                 min_prob=MIN_PROB, context=False))
    assert tokens_of(steps) == vanilla
    sizes = {s.tree_size for s in steps if s.kind == "speculative"}
    assert 0 in sizes and max(sizes) > 0, f"tree sizes {sizes}: the threshold must both keep and drop drafts here"


def test_stops_at_context_limit_with_same_tokens(prompt):
    engine = tiny_engine("llama-h48-l7-mqa", "eagle1")
    room = engine.max_context - len(prompt)
    vanilla = list(engine.generate(prompt, method="vanilla", max_new_tokens=10_000))
    eagle = list(engine.generate(prompt, method="eagle", max_new_tokens=10_000))
    assert tokens_of(eagle) == tokens_of(vanilla)
    assert len(tokens_of(eagle)) == room
    assert eagle[-1].finish_reason == vanilla[-1].finish_reason == "context"


def test_stops_at_eos_and_max_new_tokens(prompt):
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    reference = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=60))
    stop = reference[25]
    engine.stop_ids = (stop,)
    first = reference.index(stop)
    for method in ("vanilla", "eagle"):
        steps = list(engine.generate(prompt, method=method, max_new_tokens=60))
        assert tokens_of(steps) == reference[: first + 1]
        assert steps[-1].finish_reason == "eos"
        capped = list(engine.generate(prompt, method=method, max_new_tokens=first))
        assert tokens_of(capped) == reference[:first] and capped[-1].finish_reason == "length"


def test_an_engine_with_another_head_shares_the_model_and_takes_turns(prompt, tmp_path):
    """Engine.with_head (the benchmark's --compare-head): same model object, lossless, and one generation at a time."""
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    save_head(random_head(engine.model, "eagle1", seed=5), tmp_path / "eagle1")
    other = engine.with_head(tmp_path / "eagle1")
    assert other.model is engine.model and other.head.kind == "eagle1"
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))

    first = engine.generate(prompt, method="eagle", max_new_tokens=NEW_TOKENS)
    head_start = next(first).tokens  # `engine` is mid-generation: the other one must wait for it
    result = {}

    def run_other():
        result["tokens"] = tokens_of(other.generate(prompt, method="eagle", max_new_tokens=NEW_TOKENS))

    waiting = threading.Thread(target=run_other)
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive(), "the second engine ran while the first was generating on the same model"
    assert head_start + tokens_of(first) == vanilla
    waiting.join(timeout=60)
    assert result["tokens"] == vanilla


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("plain_every,plain_run", [(1, 1), (3, 1), (6, 3)])
def test_timed_plain_rounds_keep_the_output_and_the_drafter_in_step(kind, plain_every, plain_run, prompt):
    """The meter's in-turn plain steps (runs of them every n rounds) commit the base model's own token; the drafter
    is fed their slot, so the speculative rounds after them still draft (and accept) from the right state."""
    engine = tiny_engine("llama-h64-l8-gqa", kind)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=NEW_TOKENS, plain_every=plain_every,
                                 plain_run=plain_run))
    assert tokens_of(steps) == vanilla
    kinds = [s.kind for s in steps]
    assert kinds[0] == "prefill"
    expected = ["plain" if DecodeParams(plain_every=plain_every, plain_run=plain_run).plain_round(i) else "speculative"
                for i in range(len(steps) - 1)]
    assert kinds[1:] == expected
    if plain_every > 1:
        assert sum(s.accepted for s in steps) > 0
    assert all(s.accepted == 0 and len(s.tokens) == 1 for s in steps if s.kind == "plain")
