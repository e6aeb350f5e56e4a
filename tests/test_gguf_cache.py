"""The embedded GGUF is converted once into a Hugging Face folder: later loads give the very same weights and
tokenizer without parsing the GGUF, and a damaged, stale or unwritable cache costs time, never the load."""
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers.modeling_gguf_pytorch_utils as gguf_utils

from conftest import tiny_base
from engine.model import gguf_cache
from engine.model.load import embedded_gguf_path, load_model, load_tokenizer

TEXTS = ["Hello world!", "  two spaces\n\ttab", "日本語 é 🦅", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache, converted by the first test that loads."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EAGLE_CHAT_CACHE", str(path))
        yield path


def test_the_converted_copy_is_the_gguf_model_bit_for_bit(cache, tmp_path, monkeypatch, caplog):
    gguf = embedded_gguf_path()
    converted = load_model(None)
    folder = gguf_cache.converted_folder(gguf)
    assert (folder / "model.safetensors").is_file() and converted.name_or_path == str(gguf)

    blocked = tmp_path / "a-file"  # a cache root that cannot be made: the GGUF itself is loaded, with a warning
    blocked.write_text("")
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(blocked / "cache"))
    with caplog.at_level(logging.WARNING, logger="engine.model.gguf_cache"):
        direct = load_model(None)
    assert "parsing the GGUF on every load" in caplog.text
    ours, theirs = converted.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert converted.config.tie_word_embeddings == direct.config.tie_word_embeddings
    assert converted.generation_config.to_dict() == direct.generation_config.to_dict()

    original = load_tokenizer(None)  # the blocked cache: parsed from the GGUF
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(cache))
    tokenizer = load_tokenizer(None)
    assert [tokenizer(t).input_ids for t in TEXTS] == [original(t).input_ids for t in TEXTS]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "?"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == original.apply_chat_template(
        chat, add_generation_prompt=True)
    assert (tokenizer.eos_token, tokenizer.all_special_tokens, len(tokenizer)) == (
        original.eos_token, original.all_special_tokens, len(original))


def test_later_loads_do_not_parse_the_gguf_and_take_any_dtype(cache, monkeypatch):
    reference = load_model(None).state_dict()

    def parse(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", parse)
    bf16 = load_model(None, dtype="bfloat16").state_dict()
    assert all(torch.equal(bf16[k], reference[k].to(torch.bfloat16)) for k in reference)
    assert load_tokenizer(None).eos_token == "<|im_end|>"


def test_a_damaged_copy_is_converted_again(cache, caplog):
    folder = gguf_cache.converted_folder(embedded_gguf_path())
    weights = folder / "model.safetensors"
    reference = load_model(None).state_dict()
    damaged = folder / "damaged"  # written beside and renamed over: the loaded weights map the old file
    damaged.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    damaged.replace(weights)
    with caplog.at_level(logging.WARNING):
        again = load_model(None).state_dict()
    assert "does not load: removing it and converting again" in caplog.text
    assert all(torch.equal(again[k], reference[k]) for k in reference)


def test_copies_are_keyed_by_content_and_unused_ones_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    gguf, elsewhere = tmp_path / "model.gguf", tmp_path / "other" / "copy.gguf"
    gguf.write_bytes(b"GGUF one")
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"GGUF one")
    first = gguf_cache.converted_folder(gguf)
    assert first.parent == tmp_path / "cache" / "gguf" and gguf_cache.converted_folder(elsewhere) == first
    gguf.write_bytes(b"GGUF two")
    assert gguf_cache.converted_folder(gguf) != first  # changed in place: another copy
    facts = gguf_cache._source_facts(elsewhere)
    first.mkdir(parents=True)
    (first / "model.safetensors").write_bytes(b"")
    assert not gguf_cache._is_complete(first, facts)  # no source.json (written last): not used
    (first / gguf_cache.COMPLETE).write_text(json.dumps(facts, sort_keys=True))
    assert gguf_cache._is_complete(first, facts)

    recent = first.parent / "recent"
    recent.mkdir()
    (recent / gguf_cache.COMPLETE).write_text("{}")
    old = time.time() - (gguf_cache.UNUSED_DAYS + 1) * 86400
    os.utime(first / gguf_cache.COMPLETE, (old, old))
    gguf_cache._remove_unused(first.parent)
    assert not first.exists() and recent.exists()


def test_two_processes_converting_at_once_both_get_one_whole_copy(tmp_path, monkeypatch):
    """Two loads racing on a cold cache (the app and its API server, two test processes): each converts into its
    own staging folder; whichever renames first wins, the other keeps that copy, and neither removes it."""
    tokenizer = load_tokenizer(None)
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    both_loaded = threading.Barrier(2)

    def load_tiny(*args, **kwargs):  # transformers' GGUF parsing stands aside: the race is what is tested
        both_loaded.wait(timeout=60)
        return tiny_base("llama-h48-l7-mqa")

    monkeypatch.setattr(gguf_cache.AutoModelForCausalLM, "from_pretrained", load_tiny)
    monkeypatch.setattr(gguf_cache.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: gguf_cache.converted(gguf), range(2)))
    assert folders[0] == folders[1] == gguf_cache.converted_folder(gguf)
    assert gguf_cache._is_complete(folders[0], gguf_cache._source_facts(gguf))
    assert (folders[0] / "model.safetensors").is_file()
    assert [p.name for p in folders[0].parent.iterdir()] == [folders[0].name]  # no staging folder left

    weights = folders[0] / "model.safetensors"
    kept = weights.stat().st_ino
    both_loaded = threading.Barrier(1)  # alone this time: nobody to wait for
    gguf_cache._convert(gguf, gguf_cache._source_facts(gguf), True)  # finishing second, it keeps what the other reads
    assert weights.stat().st_ino == kept
