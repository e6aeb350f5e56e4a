"""The training pipeline on tiny random models: data -> features -> vocabulary -> fit -> a head that decodes
losslessly."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import Engine
from engine.draft.checkpoint import load_head
from engine.model.load import load_tokenizer
from engine.train.data import (
    Conversation,
    DataError,
    build_data,
    encode_prompt,
    read_conversations,
    read_shards,
    select_prompts,
)
from engine.train.fit import FitConfig
from engine.train.pipeline import fit_head
from engine.train.vocab import choose_vocab, coverage, token_counts

FAST = dict(ttt_steps=2, epochs=2, batch_tokens=256, warmup=2, save_every=0, eval_every=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()  # the embedded model's tokenizer: its chat template is the real one


@pytest.fixture(scope="module")
def tiny_chat_model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def write_source(path, count: int) -> None:
    with open(path, "w") as f:
        for i in range(count):
            turns = [{"from": "human", "value": f"Question {i}: what do you know about topic {7 * i}?"},
                     {"from": "gpt", "value": f"Topic {7 * i} is interesting."}]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")


def greedy(engine: Engine, ids: list[int], method: str) -> list[int]:
    return [t for step in engine.generate(ids, method=method, max_new_tokens=24) for t in step.tokens]


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_smoke_pipeline_gives_a_head_that_loads_and_decodes_losslessly(tmp_path, tokenizer, tiny_chat_model, kind):
    write_source(tmp_path / "source.jsonl", 6)
    build_data(tiny_chat_model, tokenizer, tmp_path / "data", tmp_path / "source.jsonl", batch_size=3,
               max_new_tokens=12, max_prompt_tokens=128, shard_size=3)
    records = read_shards(tmp_path / "data")
    assert len(records) == 6 and all(len(r["input_ids"]) > r["prompt_len"] for r in records)
    summary = fit_head(tiny_chat_model, [tmp_path / "data"], tmp_path / "head", tmp_path / "work", kind,
                       draft_vocab_size=300, config=FitConfig(**FAST), val_every=3)
    assert summary["steps"] == summary["total_steps"] > 0 and summary["validation"] is not None
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json", "model.safetensors"]
    head = load_head(tmp_path / "head", tiny_chat_model)
    engine = Engine.over(tiny_chat_model, tokenizer, head)
    prompt = engine.encode_chat([{"role": "user", "content": "Question 2: what do you know?"}])
    assert greedy(engine, prompt, "eagle") == greedy(engine, prompt, "vanilla")


def test_fine_tuning_starts_from_the_given_head_and_keeps_its_vocabulary(tmp_path, tokenizer, tiny_chat_model):
    write_source(tmp_path / "source.jsonl", 6)
    build_data(tiny_chat_model, tokenizer, tmp_path / "data", tmp_path / "source.jsonl", batch_size=3,
               max_new_tokens=12, max_prompt_tokens=128, shard_size=3)
    fit_head(tiny_chat_model, [tmp_path / "data"], tmp_path / "first", tmp_path / "w1", draft_vocab_size=300,
             config=FitConfig(**FAST), val_every=3, dtype=torch.float32)
    first = load_head(tmp_path / "first", tiny_chat_model)
    # zero steps: the written head is the given one, not a fresh head started from the base model
    untouched = fit_head(tiny_chat_model, [tmp_path / "data"], tmp_path / "same", tmp_path / "w2", draft_vocab_size=500,
                         config=FitConfig(**FAST), val_every=3, max_steps=0, dtype=torch.float32,
                         init=tmp_path / "first")
    same = load_head(tmp_path / "same", tiny_chat_model)
    for (name, a), (_, b) in zip(first.state_dict().items(), same.state_dict().items()):
        assert torch.equal(a, b), name
    assert untouched["steps"] == 0
    # trained on: the weights move, the draft vocabulary (300 ids, not the 500 asked) stays
    fit_head(tiny_chat_model, [tmp_path / "data"], tmp_path / "tuned", tmp_path / "w3", draft_vocab_size=500,
             config=FitConfig(**FAST), val_every=3, dtype=torch.float32, init=tmp_path / "first")
    tuned = load_head(tmp_path / "tuned", tiny_chat_model)
    assert torch.equal(tuned.d2t, first.d2t)
    assert not torch.equal(tuned.fc.weight, first.fc.weight)
    engine = Engine.over(tiny_chat_model, tokenizer, tuned)
    prompt = engine.encode_chat([{"role": "user", "content": "Question 4: what do you know?"}])
    assert greedy(engine, prompt, "eagle") == greedy(engine, prompt, "vanilla")
    with pytest.raises(ValueError, match="eagle3 head"):
        fit_head(tiny_chat_model, [tmp_path / "data"], tmp_path / "x", tmp_path / "w4", "eagle1",
                 config=FitConfig(**FAST), init=tmp_path / "first")


def test_data_resumes_without_redoing_finished_shards(tmp_path, tokenizer, tiny_chat_model, capsys):
    write_source(tmp_path / "source.jsonl", 6)
    args = dict(batch_size=2, max_new_tokens=4, max_prompt_tokens=128, shard_size=2)
    build_data(tiny_chat_model, tokenizer, tmp_path / "data", tmp_path / "source.jsonl", limit=4, **args)
    # into a log (not a terminal) the bar is drawn when it opens and closes, not once per reply and per postfix
    assert capsys.readouterr().err.count("\r") <= 2
    first = (tmp_path / "data" / "shard_00000.jsonl").read_text()
    build_data(tiny_chat_model, tokenizer, tmp_path / "data", tmp_path / "source.jsonl", limit=6, **args)
    assert (tmp_path / "data" / "shard_00000.jsonl").read_text() == first
    ids = [r["id"] for r in read_shards(tmp_path / "data")]
    assert len(ids) == len(set(ids)) == 6


def test_a_time_limit_keeps_the_replies_finished_and_a_later_run_adds_the_rest(tmp_path, tokenizer, tiny_chat_model):
    """A budget spent after the first reply writes that reply (a shard of one) and leaves the others to the next run,
    which gives the same records as one run without a limit."""
    write_source(tmp_path / "source.jsonl", 5)
    args = dict(batch_size=1, max_new_tokens=4, max_prompt_tokens=128, shard_size=2)
    build_data(tiny_chat_model, tokenizer, tmp_path / "cut", tmp_path / "source.jsonl", time_limit_s=0, **args)
    assert len(read_shards(tmp_path / "cut")) == 1
    build_data(tiny_chat_model, tokenizer, tmp_path / "cut", tmp_path / "source.jsonl", **args)
    build_data(tiny_chat_model, tokenizer, tmp_path / "whole", tmp_path / "source.jsonl", **args)
    key = lambda r: r["id"]  # noqa: E731
    assert sorted(read_shards(tmp_path / "cut"), key=key) == sorted(read_shards(tmp_path / "whole"), key=key)


def test_duplicate_prompts_are_dropped(tmp_path, tokenizer, tiny_chat_model):
    turns = [{"from": "human", "value": "Same  question?"}, {"from": "gpt", "value": "Yes."}]
    (tmp_path / "dup.json").write_text(json.dumps([{"id": str(i), "conversations": turns} for i in range(3)]))
    build_data(tiny_chat_model, tokenizer, tmp_path / "data", tmp_path / "dup.json", max_new_tokens=4)
    assert len(read_shards(tmp_path / "data")) == 1


def test_all_turns_adds_later_user_turns_after_the_first_ones(tokenizer):
    def turn(role, text):
        return {"role": role, "content": text}

    long = [turn("user", "What is a prime?"), turn("assistant", "A number with two divisors."),
            turn("user", "Is 9 one?"), turn("assistant", "No."), turn("user", "And 7?")]
    conversations = [Conversation("a", long), Conversation("b", [turn("user", "Hello there"), turn("assistant", "Hi")])]
    chosen = select_prompts(conversations, tokenizer, None, 512, turns="all")
    ids = [c[0] for c in chosen]
    assert sorted(ids[:2]) == ["a", "b"] and ids[2:] == ["a:2", "a:4"]
    ident, messages, prompt_ids, reply = chosen[ids.index("a:2")]
    assert messages == long[:3] and prompt_ids == encode_prompt(tokenizer, long[:3]) and reply == "No."
    assert sorted(c[0] for c in select_prompts(conversations, tokenizer, None, 512)) == ["a", "b"]
    assert [c[0] for c in select_prompts(conversations, tokenizer, 3, 512, turns="all")][2:] == ["a:2"]
    with pytest.raises(ValueError, match="turns must be one of first, all"):
        select_prompts(conversations, tokenizer, None, 512, turns="later")


def test_a_later_turn_too_long_leaves_out_its_oldest_exchanges_and_an_over_long_message_is_skipped(tokenizer):
    def turn(role, text):
        return {"role": role, "content": text}

    essay = "word " * 300
    system = turn("system", "Be brief.")
    chat = [system, turn("user", essay), turn("assistant", essay), turn("user", "Short one?"),
            turn("assistant", "Yes."), turn("user", "And now?")]
    limit = len(encode_prompt(tokenizer, [system] + chat[3:])) + 5  # the last two exchanges fit, the first does not
    chosen = {c[0]: c for c in select_prompts([Conversation("a", chat)], tokenizer, None, limit, turns="all")}
    assert sorted(chosen) == ["a:3", "a:5"]  # the first turn alone (300 words) is over the limit
    _, messages, ids, _ = chosen["a:5"]
    assert messages == [system] + chat[3:] and ids == encode_prompt(tokenizer, messages) and len(ids) <= limit
    assert chosen["a:3"][1] == [system, chat[3]]


@pytest.mark.parametrize("content, line", [
    ('{"conversations": [{"from": "human", "value": "hi"}]}\n\n{"conversations": [\n', 3),
    ('{"conversations": [{"from": "human", "value": "hi"}]}\n'
     '{"conversations": [{"from": "alien", "value": "x"}]}\n', 2),
    ('[\n {"conversations": [{"from": "human", "value": "hi"}]},\n'
     ' {"conversations": [{"from": "gpt" "value": 1}]}\n]', 3),
    ('[\n {"messages": [{"role": "user", "content": "hi"}]},\n {"messages": "not a list"}\n]', 3),
])
def test_malformed_data_file_names_the_line(tmp_path, content, line):
    path = tmp_path / ("data.json" if content.startswith("[") else "data.jsonl")
    path.write_text(content)
    with pytest.raises(DataError, match=rf"{path.name}:{line}:"):
        list(read_conversations(path))


def test_vocabulary_keeps_the_most_frequent_reply_tokens():
    records = [{"input_ids": [9, 9, 1, 2, 2, 2, 3], "prompt_len": 2}, {"input_ids": [5, 3, 3], "prompt_len": 1}]
    counts = token_counts(records, 10)
    assert counts.tolist() == [0, 1, 3, 3, 0, 0, 0, 0, 0, 0]  # prompt tokens (9, 5) are not counted
    used = choose_vocab(counts, 2)
    assert used.tolist() == [2, 3]
    assert coverage(counts, used) == pytest.approx(6 / 7)
    with pytest.raises(ValueError, match="draft vocabulary size"):
        choose_vocab(counts, 11)


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "live"])
def test_fine_tuning_reads_the_layers_the_heads_config_names(tmp_path, tokenizer, tiny_chat_model, monkeypatch, cache):
    """A head whose config fuses other layers than the official capture trains on those layers' features."""
    import engine.train.features as features
    from engine.draft.checkpoint import save_head
    from engine.testing.tiny import random_head

    write_source(tmp_path / "source.jsonl", 3)
    build_data(tiny_chat_model, tokenizer, tmp_path / "data", tmp_path / "source.jsonl", batch_size=3,
               max_new_tokens=8, max_prompt_tokens=128, shard_size=3)
    head = random_head(tiny_chat_model, "eagle3")
    head.config.target_layers = [1, 3, 6]
    save_head(head, tmp_path / "named", torch.float32)
    asked = []
    real = features.target_features
    monkeypatch.setattr(features, "target_features", lambda model, ids, valid, layers, *rest: (
        asked.append(layers), real(model, ids, valid, layers, *rest))[1])
    fit_head(tiny_chat_model, [tmp_path / "data"], tmp_path / "tuned", tmp_path / "work", config=FitConfig(**FAST),
             val_every=0, max_steps=1, dtype=torch.float32, init=tmp_path / "named", cache=cache)
    assert asked and all(layers == [1, 3, 6] for layers in asked)
    assert load_head(tmp_path / "tuned", tiny_chat_model).feature_layers(8) == [1, 3, 6]
