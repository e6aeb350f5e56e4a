"""Bad input gets a clear, specific error."""
import pytest

from conftest import tiny_engine
from engine import ContextTooLong


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama-h64-l8-gqa", "eagle3")


def test_unknown_method(engine, prompt):
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        engine.generate(prompt, method="beam")


def test_empty_and_too_long_prompts(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([], method="eagle")
    with pytest.raises(ContextTooLong, match="context holds 256"):
        engine.generate([1] * 300, method="eagle")


def test_bad_parameters(engine, prompt):
    for params, message in [
        (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(tree="bushy"), "unknown tree"), (dict(depth=0), "depth"), (dict(plain_every=-1), "plain_every"),
        (dict(plain_every=4, plain_run=5), "plain_run"), (dict(plain_every=4, plain_run=0), "plain_run"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompt, method="eagle", **params)


def test_eagle_without_head(prompt):
    with pytest.raises(ValueError, match="needs a draft head"):
        tiny_engine("llama-h64-l8-gqa", None).generate(prompt, method="eagle")


@pytest.mark.parametrize(
    "messages,message",
    [
        ([], "conversation is empty"),
        ("hello", "conversation is empty"),
        ([{"role": "user", "content": ["an image"]}], "non-text content"),
        ([{"role": "wizard", "content": "hi"}], "needs a role"),
        ([{"role": "user", "content": "   "}], "last user message is empty"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "must come from the user"),
    ],
)
def test_bad_conversations(engine, messages, message):
    with pytest.raises(ValueError, match=message):
        engine.encode_chat(messages)
