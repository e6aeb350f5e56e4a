"""Models that do not chat: a base model without a chat template (or --no-chat-template) continues plain text, in the
library, the bench's prompts and the app, losslessly as ever."""
from __future__ import annotations

import pytest

from app.chat import ChatService
from app.models_panel import COMPLETING
from app.ui import build_demo
from conftest import random_head, tiny_base, tokens_of
from engine import Engine, LoadOptions
from engine.engine import PLAIN_TURNS
from engine.model.load import load_tokenizer
from engine.tools.runs import first_turn_prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def completing(tokenizer) -> Engine:
    model = tiny_base("llama-h64-l8-gqa", vocab=len(tokenizer))
    return Engine.over(model, tokenizer, random_head(model, "eagle3"), chat_template=False)


def test_a_model_without_a_chat_template_continues_the_text(completing, tokenizer):
    assert not completing.chats
    text = "The three largest rivers of Europe are"
    assert completing.encode_chat([{"role": "user", "content": text}]) == tokenizer(text)["input_ids"]
    turns = [{"role": "system", "content": "Rivers."}, {"role": "user", "content": "The Danube"},
             {"role": "assistant", "content": "flows east."}, {"role": "user", "content": "The Rhine"}]
    assert completing.encode_chat(turns) == tokenizer(PLAIN_TURNS.join(m["content"] for m in turns))["input_ids"]
    assert completing.encode_text(text) == tokenizer(text)["input_ids"]
    with pytest.raises(ValueError, match="the prompt is empty"):
        completing.encode_text("  ")


def test_a_tokenizer_without_a_template_never_chats(tokenizer):
    model = tiny_base("llama-h64-l8-gqa", vocab=len(tokenizer))
    tokenizer_without = load_tokenizer()
    tokenizer_without.chat_template = None
    assert not Engine.over(model, tokenizer_without).chats
    assert Engine.over(model, tokenizer).chats


def test_completion_is_lossless(completing):
    prompt = "Once upon a time, in a quiet village by the sea,"
    vanilla = tokens_of(completing.complete(prompt, method="vanilla", max_new_tokens=24))
    assert tokens_of(completing.complete(prompt, method="eagle", max_new_tokens=24, total_tokens=8, depth=3)) == vanilla
    assert tokens_of(completing.complete(prompt, method="suffix", max_new_tokens=24)) == vanilla


def test_the_bench_prompts_a_model_that_does_not_chat_with_plain_text(completing, tokenizer):
    questions = [{"question_id": 1, "category": "writing", "turns": ["Write a haiku about rivers."]}]
    assert first_turn_prompts(completing, questions) == [tokenizer("Write a haiku about rivers.")["input_ids"]]


def page_text(engine: Engine) -> str:
    return repr(build_demo(ChatService(engine)).config["components"])


def test_the_page_says_it_is_completing(completing, tokenizer):
    page = page_text(completing)
    assert COMPLETING in page and "no chat template: completes plain text" in page
    chatting = Engine.over(tiny_base("llama-h64-l8-gqa", vocab=len(tokenizer)), tokenizer)
    assert "no chat template" not in page_text(chatting)


def test_the_flag_reaches_the_engine():
    import argparse

    parser = argparse.ArgumentParser()
    LoadOptions.add_arguments(parser)
    assert LoadOptions.from_args(parser.parse_args([])).chat_template
    assert not LoadOptions.from_args(parser.parse_args(["--no-chat-template"])).chat_template
