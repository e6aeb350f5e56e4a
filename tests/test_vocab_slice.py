"""Slicing an EAGLE-3 head's draft vocabulary to its most frequent tokens: the kept rows compute what they did, map
to the same base ids, round-trip through the official layout, and decoding with the slice stays lossless."""
import json

import pytest
import torch

from conftest import VOCAB, IdsOnlyTokenizer, random_head, tiny_base, tokens_of
from engine import Engine
from engine.draft.checkpoint import load_head, new_head, place_head, save_head
from engine.draft.records import save_records
from engine.train.__main__ import main
from engine.train.vocab import draft_targets, slice_vocab

SIZE = 6
NEW_TOKENS = 80


@pytest.fixture
def model():
    return tiny_base("llama-h64-l8-gqa")


@pytest.fixture
def head(model):
    return random_head(model, "eagle3")


@pytest.fixture
def counts() -> torch.Tensor:
    """Distinct counts (no ties), so the most frequent tokens are one set."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7)) + 1


def most_frequent_targets(head, counts: torch.Tensor, size: int) -> list[int]:
    targets = draft_targets(head)
    return sorted(targets[counts[targets].argsort(descending=True)[:size]].tolist())


def draft_logits(head, model, prompt: list[int]) -> torch.Tensor:
    """The head's draft logits at every slot of the prompt (slot p: base features after token p, token p + 1)."""
    engine = Engine.over(model, IdsOnlyTokenizer(), head)
    _, features = engine.target.forward(torch.tensor(prompt), engine.target.new_cache())
    n = len(prompt)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    out, _ = head(features[None], torch.tensor([prompt[1:] + [0]]), torch.arange(n), None, causal, from_target=True)
    return head.logits(out)


def test_keeps_exactly_the_most_frequent_draft_tokens(head, counts):
    outside = sorted(set(range(VOCAB)) - set(draft_targets(head).tolist()))
    counts[outside[0]] = 10 * VOCAB  # the most frequent token of all, but not one the head can draft
    sliced = slice_vocab(head, counts, SIZE)
    assert sliced.config.draft_vocab_size == SIZE and sliced.lm_head.weight.shape[0] == SIZE
    assert draft_targets(sliced).tolist() == most_frequent_targets(head, counts, SIZE)
    assert sliced.t2d.nonzero().flatten().tolist() == draft_targets(sliced).tolist()


def test_kept_rows_give_the_same_logits_and_base_ids(head, model, counts, prompt):
    sliced = slice_vocab(head, counts, SIZE)
    targets = draft_targets(head)
    kept = torch.searchsorted(targets, draft_targets(sliced))  # the original draft ids of the kept tokens
    assert torch.equal(head.to_target(kept), sliced.to_target(torch.arange(SIZE)))
    assert torch.equal(sliced.lm_head.weight, head.lm_head.weight[kept])
    # The same rows times the same hidden states; a matmul over fewer rows may round its last bit differently.
    torch.testing.assert_close(draft_logits(sliced, model, prompt), draft_logits(head, model, prompt)[..., kept],
                               rtol=1e-6, atol=1e-6)


def test_everything_but_the_vocabulary_is_unchanged(head, counts):
    sliced = slice_vocab(head, counts, SIZE)
    original, cut = head.state_dict(), sliced.state_dict()
    assert original.keys() == cut.keys()
    for key in original.keys() - {"lm_head.weight", "d2t", "t2d"}:
        assert torch.equal(original[key], cut[key]), key
    assert head.config.draft_vocab_size == VOCAB - 4 and head.lm_head.weight.shape[0] == VOCAB - 4  # not sliced


def test_round_trips_through_the_official_layout(head, model, counts, tmp_path):
    sliced = slice_vocab(head, counts, SIZE)
    save_head(sliced, tmp_path / "sliced")
    assert json.loads((tmp_path / "sliced" / "config.json").read_text())["draft_vocab_size"] == SIZE
    again = load_head(tmp_path / "sliced", model)
    saved, loaded = sliced.state_dict(), again.state_dict()
    assert saved.keys() == loaded.keys()
    for key, tensor in saved.items():
        assert torch.equal(tensor, loaded[key]), key


@pytest.mark.parametrize("size", [1, SIZE, VOCAB - 4])
def test_greedy_eagle_with_the_slice_equals_vanilla(head, model, counts, prompt, size):
    engine = Engine.over(model, IdsOnlyTokenizer(), slice_vocab(head, counts, size))
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=NEW_TOKENS))
    assert tokens_of(steps) == vanilla
    assert sum(s.accepted for s in steps) > 0, "no draft was accepted: the sliced rows were never exercised"


def test_refuses_heads_without_a_draft_vocabulary_and_sizes_out_of_range(head, model, counts):
    with pytest.raises(ValueError, match="only an EAGLE-3 head.*eagle1"):
        slice_vocab(random_head(model, "eagle1"), counts, SIZE)
    full = place_head(new_head("eagle3", model.config), model)
    with pytest.raises(ValueError, match="no d2t map"):
        slice_vocab(full, counts, SIZE)
    for size in (0, VOCAB - 3):
        with pytest.raises(ValueError, match=rf"1\.\.{VOCAB - 4}.*got {size}"):
            slice_vocab(head, counts, size)


def records_with(counts: torch.Tensor) -> list[dict]:
    """Records whose replies hold each token `counts` times (after a two-token prompt that is not counted)."""
    reply = [t for t, n in enumerate(counts.tolist()) for _ in range(n)]
    return [{"id": "a", "input_ids": [0, 0] + reply, "prompt_len": 2}]


def test_command_slices_a_head_from_record_files(head, model, counts, tmp_path, capsys):
    model.save_pretrained(tmp_path / "base")
    save_head(head, tmp_path / "head")
    save_records(records_with(counts), tmp_path / "data" / "records.npz")
    main(["slice", "--base", str(tmp_path / "base"), "--head", str(tmp_path / "head"), "--data",
          str(tmp_path / "data"), "--size", str(SIZE), "--out", str(tmp_path / "sliced")])
    sliced = load_head(tmp_path / "sliced", model)
    assert draft_targets(sliced).tolist() == most_frequent_targets(head, counts, SIZE)
    assert f"{VOCAB - 4} -> {SIZE}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="got 0"):
        main(["slice", "--base", str(tmp_path / "base"), "--head", str(tmp_path / "head"), "--data",
              str(tmp_path / "data"), "--size", "0", "--out", str(tmp_path / "none")])
    assert not (tmp_path / "none").exists()
