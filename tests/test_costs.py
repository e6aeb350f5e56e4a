"""engine.decode.costs.row_cost: a verified row's price in plain steps, measured once per machine and model shape and
read back after, and measured still where the cache folder cannot be written; the floor it sets under the head's
drafts."""
import json

import pytest
import torch

from conftest import tiny_engine, tokens_of
from engine import DecodeParams
from engine.decode import costs
from engine.decode.params import MAX_FLOOR
from engine.draft.context import ChainAcceptance


def test_the_row_cost_is_measured_once_and_kept_by_machine_and_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path))
    measured = []
    curve = costs.verification_curve
    monkeypatch.setattr(costs, "verification_curve", lambda *a, **k: measured.append(a[1]) or curve(*a, **k))
    target = tiny_engine("llama-h64-l8-gqa", None).target
    first = costs.row_cost(target)
    assert first >= 0 and measured == [costs.ROW_COST_SIZES]
    kept = json.loads((tmp_path / "row-costs.json").read_text())
    [key] = kept
    assert kept[key] == first and "threads" in key and "llama 8x64" in key
    kept[key] = 0.125  # what is kept is what a later engine of that shape on this machine uses
    (tmp_path / "row-costs.json").write_text(json.dumps(kept))
    assert costs.row_cost(tiny_engine("llama-h64-l8-gqa", "eagle3").target) == 0.125 and len(measured) == 1
    costs.row_cost(tiny_engine("qwen2-h32-l10-tied", None).target)  # another shape: measured, kept beside
    assert len(measured) == 2 and len(json.loads((tmp_path / "row-costs.json").read_text())) == 2


@pytest.mark.parametrize("damage", ["unreadable", "unwritable"])
def test_a_damaged_or_unwritable_cache_is_measured_again(tmp_path, monkeypatch, damage):
    folder = tmp_path / "cache"
    if damage == "unreadable":
        folder.mkdir()
        (folder / "row-costs.json").write_text("{not json")
    else:
        folder.write_text("a file where the folder should be")
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(folder))
    assert costs.row_cost(tiny_engine("llama-h64-l8-gqa", None).target) >= 0


def test_the_heads_floor_is_the_row_cost_unless_one_is_given():
    params = DecodeParams()
    assert params.tree.min_prob is None and params.floors_at_row_cost
    assert params.with_row_cost(0.16).tree.min_prob == 0.16
    assert params.with_row_cost(3.0).tree.min_prob == MAX_FLOOR  # a draft the head is that sure of is verified
    assert params.with_options(min_prob=0.0).with_row_cost(0.16).tree.min_prob == 0.0  # given: kept
    seeded = params.with_options(temperature=0.7, seed=1)  # its draws follow the drafts: nothing measured moves them
    assert seeded.with_row_cost(0.16).tree.min_prob is None
    assert params.with_options(tree="static").with_row_cost(0.16) == params.with_options(tree="static")


def test_an_engine_verifies_only_the_drafts_its_row_cost_pays_for(prompt):
    """The engine floors the head's drafts at its measured row cost: at a row as dear as a step no draft of a head
    unsure of every token is sure enough, every round is a plain step, and the tokens stay plain decoding's."""
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    with torch.no_grad():  # its final norm scaled down: logits near zero, no draft near MAX_FLOOR
        engine.head.norm.weight.mul_(0.01)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=30))
    engine.chain_acceptance = ChainAcceptance(row_cost=1.0)
    dear = list(engine.generate(prompt, method="eagle", context=False, max_new_tokens=30))
    assert tokens_of(dear) == vanilla and all(step.tree_size == 0 for step in dear)
    engine.chain_acceptance = ChainAcceptance(row_cost=0.0)
    free = list(engine.generate(prompt, method="eagle", context=False, max_new_tokens=30))
    assert tokens_of(free) == vanilla and all(step.tree_size == 1 for step in free if step.kind == "speculative")
