"""Training a head for one's own GGUF, on every architecture the engine runs: `python -m engine.train all --base
FILE.gguf --smoke` on a tiny GGUF of each gives a head that loads with its base and decodes greedily exactly as
plain decoding does, from data that is the base model's own decoding of the prompts the engine would give it."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from engine import Engine
from engine.model.packed import PackedLinear
from engine.testing.tiny import tiny_base
from engine.testing.tiny_gguf import GGUF_SHAPES, tiny_gguf
from engine.train.__main__ import main
from engine.train.data import read_shards
from engine.train.fit import linear_weight, norm_scale
from engine.model.fused import sliding_window

TOPICS = ["the sea", "mountains", "old maps", "bread", "rivers in spring", "a quiet town", "trains", "the moon"]


def write_source(path) -> None:
    with open(path, "w") as f:
        for i, topic in enumerate(TOPICS):
            turns = [{"from": "human", "value": f"Tell me something about {topic}."},
                     {"from": "gpt", "value": f"Here is something about {topic}."}]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")


def greedy(engine: Engine, ids: list[int], method: str) -> list[int]:
    return [t for step in engine.generate(ids, method=method, max_new_tokens=48) for t in step.tokens]


# Q8_0 files run on the grouped kernels (int8 where they build), as a quantized GGUF does; F32 on float layers.
@pytest.mark.parametrize("architecture, types, chat_template",
                         [(a, "Q8_0", True) for a in GGUF_SHAPES] + [("gemma3", "F32", False)])
def test_train_all_smoke_gives_a_head_that_decodes_its_gguf_base_losslessly(tmp_path, monkeypatch, architecture, types,
                                                                           chat_template):
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    base = tiny_gguf(architecture, tmp_path, types, chat_template)
    write_source(tmp_path / "source.jsonl")
    main(["all", "--base", str(base), "--smoke", "--source", str(tmp_path / "source.jsonl"),
          "--out", str(tmp_path / "head"), "--work", str(tmp_path / "work")])

    engine = Engine.load(str(base), head=str(tmp_path / "head"), corpus=None)
    layers = engine.model.config.get_text_config().num_hidden_layers
    assert engine.head.kind == "eagle3" and engine.chats == chat_template
    assert engine.target.feature_layers == [2, layers // 2, layers - 3]  # low, middle and high, as EAGLE-3 fuses
    records = read_shards(tmp_path / "work" / "data")
    assert len(records) == 6
    for record in records:  # prompts as the engine encodes them; replies its own plain decoding
        prompt, reply = record["input_ids"][: record["prompt_len"]], record["input_ids"][record["prompt_len"]:]
        assert prompt == engine.encode_chat(record["prompt"])
        assert [t for s in engine.generate(prompt, method="vanilla", max_new_tokens=len(reply)) for t in s.tokens] \
            == reply
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me something about the sea and its ships."}])
    assert len(prompt) + 48 > (sliding_window(engine.model) or 0)  # past the window of Gemma 3's local layers
    assert greedy(engine, prompt, "eagle") == greedy(engine, prompt, "vanilla")


def test_a_packed_layer_gives_back_its_weight_exactly():
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=False)
    assert torch.equal(linear_weight(PackedLinear(linear)), linear.weight.detach())


@pytest.mark.parametrize("shape, offset", [("gemma3-h64-l8-swa", 1.0), ("llama-h64-l8-gqa", 0.0)])
def test_a_new_head_takes_the_scale_the_base_norm_applies(shape, offset):
    norm = tiny_base(shape).get_decoder().norm
    torch.testing.assert_close(norm_scale(norm, norm.weight.shape[0]), norm.weight + offset, rtol=1e-5, atol=0)
