"""Bad input gets a clear, specific error."""
import pytest

from conftest import tiny_engine
from engine import ContextTooLong
from engine.testing.tiny_gguf import GGUF_DAMAGES, damaged_gguf, tiny_gguf


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


def _damaged_ggufs(folder):
    """The embedded GGUF cut in half, cut inside its header, emptied, with a bad version, and a file that is not
    GGUF at all: each with the message that must name it."""
    from engine.model.load import embedded_gguf_path

    data = embedded_gguf_path().read_bytes()
    files = {
        "truncated": (data[: len(data) // 2], "is truncated: its tensors need"),
        "cut-header": (data[:3000], "is not a readable GGUF file: its header is damaged"),
        "empty": (b"", "is empty"),
        "version": (data[:4] + (99).to_bytes(4, "little") + data[8:4096], "GGUF version 99 is not supported"),
        "not-gguf": (b"hello world" * 100, "is not a GGUF file"),
    }
    for name, (content, message) in files.items():
        (folder / f"{name}.gguf").write_bytes(content)
    return {name: (folder / f"{name}.gguf", message) for name, (_, message) in files.items()}


def test_a_damaged_gguf_is_refused_by_name_before_it_is_parsed(tmp_path, monkeypatch):
    from engine import Engine

    monkeypatch.setattr("engine.model.load.AutoModelForCausalLM.from_pretrained",
                        lambda *args, **kwargs: pytest.fail("a damaged file reached transformers"))
    for path, message in _damaged_ggufs(tmp_path).values():
        with pytest.raises(ValueError, match=f"^{path}(:)? {message}"):
            Engine.load(str(path), head=None)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return tiny_gguf("llama", tmp_path_factory.mktemp("tiny"), types="Q8_0")


@pytest.mark.parametrize("damage", GGUF_DAMAGES)
def test_a_gguf_damaged_at_an_edge_is_refused_by_name_and_what_is_wrong(tiny_file, damage, tmp_path, monkeypatch):
    """A few bytes short, cut inside the metadata or the tensor table, or a header that lies: refused by the reader
    with the file and the fault named, before transformers or the kernels see a byte of it."""
    from engine import Engine

    monkeypatch.setattr("engine.model.load.AutoModelForCausalLM.from_pretrained",
                        lambda *args, **kwargs: pytest.fail("a damaged file reached transformers"))
    path, message = damaged_gguf(tiny_file, tmp_path, damage)
    with pytest.raises(ValueError) as refused:
        Engine.load(str(path), head=None)
    assert str(refused.value).startswith(str(path)) and message in str(refused.value), str(refused.value)
