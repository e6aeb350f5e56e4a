"""/v1/completions through the official openai client, on a tiny random model with the real tokenizer that does not
chat: the text is the engine's own greedy decoding, EAGLE's equals plain decoding's, and refusals name their field."""
from __future__ import annotations

import openai
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from app.api import Access, Api
from app.chat import ChatService
from conftest import random_head, tiny_base, tokens_of
from engine import DecodeParams, Engine
from engine.model.load import load_tokenizer

CONTEXT = 256  # the tiny model's context window, so an answer that runs to its end is cheap
PROMPT = "The three largest rivers of Europe are"
TOKENS = 20


@pytest.fixture(scope="module")
def engine() -> Engine:
    tokenizer = load_tokenizer()
    model = tiny_base("llama-h64-l8-gqa", vocab=len(tokenizer))
    model.config.max_position_embeddings = CONTEXT
    return Engine.over(model, tokenizer, random_head(model, "eagle3"), chat_template=False)


def served(engine: Engine, models: dict[str, str], max_new_tokens: int | None = None) -> openai.OpenAI:
    """The openai client, talking to the API's routes in this process."""
    api = Api(Access(), max_new_tokens)
    api.attach(ChatService(engine), models)
    http = TestClient(Starlette(routes=api.routes()))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return served(engine, {"m": "vanilla", "m+h": "eagle"})


@pytest.fixture(scope="module")
def greedy(engine) -> str:
    """The engine's own greedy plain decoding of PROMPT, decoded as the app shows an answer."""
    steps = engine.generate(engine.encode_text(PROMPT), DecodeParams(method="vanilla", max_new_tokens=TOKENS))
    ids = tokens_of(list(steps))
    assert len(ids) == TOKENS, "the random model ended early: pick another prompt"
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def complete(client: openai.OpenAI, model: str = "m+h", **options) -> openai.types.Completion:
    return client.completions.create(model=model, **{"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                                     **options})


def test_the_text_is_the_engines_greedy_decoding_and_eagle_is_lossless(client, engine, greedy):
    plain, eagle = complete(client, "m"), complete(client, "m+h")
    for answer in (plain, eagle):
        assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
        choice, = answer.choices
        assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, greedy, "length", None)
        assert answer.usage.prompt_tokens == len(engine.encode_text(PROMPT))
        assert answer.usage.completion_tokens == TOKENS
    assert plain.model_extra["eagle"]["method"] == "vanilla"
    assert eagle.model_extra["eagle"]["method"] == "eagle" and eagle.model_extra["eagle"]["rounds"] > 0


def test_a_stream_gives_the_same_text_in_chunks(client, greedy):
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}))
    *texts, last, usage = chunks
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in texts) == greedy and len(texts) > 1
    assert all(c.choices[0].finish_reason is None for c in texts)
    assert (last.choices[0].text, last.choices[0].finish_reason) == ("", "length")
    assert last.model_extra["eagle"]["method"] == "eagle"
    assert usage.choices == [] and usage.usage.completion_tokens == TOKENS


def test_a_stop_string_cuts_the_text(client, greedy):
    stop = greedy[len(greedy) // 2 :][:3]
    choice, = complete(client, stop=[stop]).choices
    assert (choice.text, choice.finish_reason) == (greedy[: greedy.find(stop)], "stop")
    streamed = list(complete(client, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_an_answer_may_run_to_the_end_of_the_context(client):
    answer = complete(client, "m", max_tokens=1000)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.total_tokens == CONTEXT


def test_the_servers_max_new_tokens_cuts_a_longer_max_tokens(engine):
    answer = complete(served(engine, {"m": "vanilla"}, max_new_tokens=8), "m", max_tokens=1000)
    assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("length", 8)


def refusal(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value


def test_a_prompt_over_the_context_is_refused(client):
    err = refusal(lambda: complete(client, prompt="river " * CONTEXT))
    assert (err.code, err.param) == ("context_length_exceeded", "prompt")
    assert "the prompt is" in err.message and f"context of {CONTEXT} tokens leaves no room" in err.message


@pytest.mark.parametrize("options, field", [
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"),
    ({"logprobs": 2}, "logprobs"),
    ({"suffix": "."}, "suffix"),
    ({"n": 2}, "n"),
    ({"prompt": ["one prompt", "another"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
])
def test_what_the_engine_cannot_honour_is_refused_by_name(client, options, field):
    assert refusal(lambda: complete(client, **options)).param == field


def test_neutral_fields_and_a_list_of_one_prompt_are_accepted(client, greedy):
    choice, = complete(client, prompt=[PROMPT], echo=False, best_of=1, user="me").choices
    assert choice.text == greedy


def test_the_chat_route_still_answers_through_the_shared_code(client, greedy):
    """This model does not chat: one user message is continued as plain text, as the completions route does."""
    answer = client.chat.completions.create(model="m+h", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=TOKENS, temperature=0)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (greedy, "length")
    too_long = [{"role": "user", "content": "river " * CONTEXT}]
    err = refusal(lambda: client.chat.completions.create(model="m", messages=too_long))
    assert (err.code, err.param) == ("context_length_exceeded", "messages")
