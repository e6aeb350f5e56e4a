"""Tiny models as real GGUF files (engine/testing/tiny.py): the K-quant encoders give blocks that gguf-py and
transformers decode alike and close to the weights, and each architecture's file reads back in transformers as the
same model, its weights exactly (float32) or as their blocks dequantize, with a working tokenizer; every norm and bias
of a tiny model, its head and its file carries drawn values, not the one or zero random initialisation leaves."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, get_tensor_name_map
from gguf.quants import Q4_K, dequantize
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.gguf.dequant import dequantize as transformers_dequantize

from engine.testing.tiny import MORE_SHAPES, SHAPES, random_head, tiny_base
from engine.testing.tiny_gguf import (
    ARCHITECTURES, GGUF_PY_KINDS, GGUF_SHAPES, GGUF_VOCAB, K_QUANTS, SPECIALS, quantize_blocks, quantize_k, tiny_gguf,
    tiny_vocabulary, write_gguf,
)

TOPS = {"Q4_K": (15, 32), "Q5_K": (31, 32), "Q6_K": (31, 16)}  # the codes a sub-block's range spans; its size
# The norms and biases each family has, which random initialisation leaves at one (Gemma's offset norms: zero) and
# zero: every one must be present in the tiny models, with drawn values.
DRAWN = {
    "llama": ("input_layernorm", "post_attention_layernorm", "model.norm"),
    "qwen2": ("input_layernorm", "post_attention_layernorm", "model.norm", "q_proj.bias", "k_proj.bias", "v_proj.bias"),
    "qwen3": ("input_layernorm", "post_attention_layernorm", "model.norm", "q_norm", "k_norm"),
    "gemma3_text": ("input_layernorm", "post_attention_layernorm", "model.norm", "q_norm", "k_norm",
                    "pre_feedforward_layernorm", "post_feedforward_layernorm"),
}


def awkward_weights(rows: int = 6, blocks: int = 3) -> np.ndarray:
    """Random rows with blocks that test the edges: all positive, all zero, all negative, one large weight."""
    w = np.random.default_rng(0).standard_normal((rows, 256 * blocks)).astype(np.float32) * 0.3
    w[0, :256] = np.abs(w[0, :256]) + 1
    w[1, :256] = 0
    w[2, :256] = -np.abs(w[2, :256]) - 2
    w[3, 7] = 25.0
    return w


def ranges(w: np.ndarray, kind: str) -> np.ndarray:
    """Each sub-block's range as the type codes it [rows, sub-blocks]: min (at most 0) to max, or +-max|w|."""
    sub = w.reshape(w.shape[0], -1, TOPS[kind][1])
    if kind == "Q6_K":
        return 2 * np.abs(sub).max(-1)
    return sub.max(-1) - np.minimum(sub.min(-1), 0)


@pytest.mark.parametrize("kind", K_QUANTS)
def test_k_quant_blocks_decode_close_to_the_weights_alike_in_gguf_py_and_transformers(kind):
    w = awkward_weights()
    blocks = quantize_k(w, kind)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert blocks.dtype == np.uint8 and blocks.shape == (w.shape[0], w.shape[1] // block_size * type_size)
    decoded = dequantize(blocks, GGMLQuantizationType[kind])
    theirs = transformers_dequantize(torch.from_numpy(blocks.copy()), GGMLQuantizationType[kind].value)
    assert np.array_equal(decoded.reshape(-1), theirs.numpy())  # two decoders of ggml's layout agree
    # within half a step of the sub-block's own range, plus what coding its scale and min against the block's
    # largest costs
    top, size = TOPS[kind]
    span = ranges(w, kind)
    largest = span.reshape(w.shape[0], -1, 256 // size).max(-1, keepdims=True)
    bound = (0.5 * span.reshape(largest.shape[0], largest.shape[1], -1) + largest / 31) / top + 1e-6
    error = np.abs(decoded - w).reshape(w.shape[0], -1, size).max(-1)
    assert (error <= bound.reshape(error.shape)).all()
    assert np.array_equal(decoded[1, :256], np.zeros(256))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quant_scales_and_mins_take_the_full_six_bit_range(kind):
    w = awkward_weights()
    blocks = quantize_k(w, kind).reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1])
    scales, mins = Q4_K.get_scale_min(blocks[:, 4:16])
    has_negative = (w.reshape(-1, 256) < 0).any(-1)
    spread = w.reshape(-1, 256).max(-1) > np.minimum(w.reshape(-1, 256).min(-1), 0)
    assert (scales.max(-1) == 63)[spread].all() and (scales == 0)[~spread].all()
    assert (mins.max(-1) == 63)[has_negative].all() and (mins == 0)[~has_negative].all()


def test_q6_k_scales_take_the_int8_range():
    w = awkward_weights()
    blocks = quantize_k(w, "Q6_K").reshape(-1, 210)
    scales = blocks[:, 192:208].view(np.int8)
    nonzero = np.abs(w.reshape(-1, 256)).max(-1) > 0
    assert (scales.max(-1) == 127)[nonzero].all() and (scales >= 0).all()


@pytest.mark.parametrize("kind", GGUF_PY_KINDS + K_QUANTS)
def test_every_type_gives_the_bytes_a_gguf_file_stores(kind):
    w = awkward_weights(rows=4, blocks=1)
    blocks = quantize_blocks(w, kind)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert blocks.dtype == np.uint8 and blocks.shape == (4, 256 // block_size * type_size)
    decoded = dequantize(blocks, GGMLQuantizationType[kind])
    assert np.allclose(decoded, w, atol=0.25 * np.abs(w).max())
    if kind == "F32":
        assert np.array_equal(decoded, w)


def test_k_quants_need_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((2, 96), np.float32), "Q4_K")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("size", [16, 40, GGUF_VOCAB, 1000])
def test_a_tiny_vocabulary_has_exactly_its_size_in_distinct_tokens(model, size):
    tokens, types, merges = tiny_vocabulary(size, model)
    assert len(tokens) == len(types) == len(set(tokens)) == size and tokens[: len(SPECIALS)] == list(SPECIALS)
    for merge in merges:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= set(tokens)


@pytest.mark.parametrize("architecture", GGUF_SHAPES)
def test_each_architecture_reads_back_as_the_same_model_with_a_tokenizer(tmp_path, architecture):
    path = tiny_gguf(architecture, tmp_path)
    model = tiny_base(GGUF_SHAPES[architecture], GGUF_VOCAB)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    assert type(loaded) is type(model)
    want, got = model.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "Hello there, the world\nüñ"
    ids = tokenizer(text)["input_ids"]
    assert len(tokenizer) == GGUF_VOCAB and max(ids) < GGUF_VOCAB and tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_a_base_model_file_has_no_chat_template(tmp_path):
    path = tiny_gguf("llama", tmp_path, chat_template=False)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert not tokenizer.chat_template and tokenizer.eos_token == "<eos>"


def expected_weights(model, path) -> dict[str, torch.Tensor]:
    """The model's weights as the file's tensor types round them."""
    arch = ARCHITECTURES[model.config.model_type]
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    expected = {}
    for name, tensor in model.state_dict().items():
        kind = types[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        blocks = quantize_blocks(tensor.numpy(), kind.name)
        expected[name] = torch.from_numpy(dequantize(blocks, kind).reshape(tensor.shape))
    return expected


def test_quantized_tensors_read_back_as_their_blocks_dequantize(tmp_path):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=GGUF_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=256)
    model = Qwen3ForCausalLM(config).eval()
    types = {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q5_K", "token_embd": "Q8_0", "output": "Q6_K"}
    path = write_gguf(model, tmp_path / "qwen3-k.gguf", types)
    stored = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert stored["blk.0.attn_q.weight"] == "Q4_K" and stored["blk.0.attn_v.weight"] == "Q6_K"
    assert stored["blk.0.ffn_down.weight"] == "Q5_K" and stored["token_embd.weight"] == "Q8_0"
    assert stored["blk.0.attn_q_norm.weight"] == stored["output_norm.weight"] == "F32"
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    got = loaded.state_dict()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected_weights(model, path).items())


def test_rows_that_do_not_split_into_blocks_take_llama_cpps_fallback(tmp_path):
    model = tiny_base("llama-h48-l7-mqa", GGUF_VOCAB)  # rows of 48 (no whole block) and 96 (three of 32)
    path = write_gguf(model, tmp_path / "llama-q4k.gguf", "Q4_K")
    stored = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert stored["blk.0.attn_q.weight"] == "F16" and stored["blk.0.ffn_down.weight"] == "Q5_0"
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    got = loaded.state_dict()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected_weights(model, path).items())


def test_a_model_transformers_would_read_as_another_is_refused(tmp_path):
    # transformers' GGUF loader takes Qwen3's head_dim from its config default (128), not from the file
    with pytest.raises(ValueError, match="head_dim"):
        write_gguf(tiny_base("qwen3-h64-l9", GGUF_VOCAB), tmp_path / "qwen3.gguf")


def norms_and_biases(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in module.named_parameters() if name.endswith(("norm.weight", ".bias"))}


def assert_drawn(name: str, values: torch.Tensor | np.ndarray, untouched: float) -> None:
    """Values unlike what initialisation leaves (`untouched`): none of a bias zero, a norm varied and not all one."""
    values = torch.as_tensor(np.array(values))  # a copy: a GGUF tensor is a read-only view
    if name.endswith(".bias"):
        assert (values != 0).all(), f"{name} has zeros"
    assert (values != untouched).any() and values.unique().numel() > 1, f"{name} is left as initialised"


@pytest.mark.parametrize("shape", SHAPES | MORE_SHAPES)
def test_every_norm_and_bias_of_a_tiny_model_is_drawn_from_its_seed(shape):
    model = tiny_base(shape)
    drawn = norms_and_biases(model)
    assert all(any(role in name for name in drawn) for role in DRAWN[model.config.model_type]), sorted(drawn)
    offset = model.config.model_type == "gemma3_text"  # its norms scale by 1 + w: untouched at zero
    for name, values in drawn.items():
        assert_drawn(name, values, 0 if offset or name.endswith(".bias") else 1)
    again, other = norms_and_biases(tiny_base(shape)), norms_and_biases(tiny_base(shape, seed=1))
    assert all(torch.equal(again[name], values) for name, values in drawn.items())
    assert not all(torch.equal(other[name], values) for name, values in drawn.items())


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_every_norm_and_bias_of_a_random_head_is_drawn(kind):
    drawn = norms_and_biases(random_head(tiny_base("qwen2-h32-l10-tied"), kind))
    assert any(name.endswith("norm.weight") for name in drawn)
    for name, values in drawn.items():
        assert_drawn(name, values, 0 if name.endswith(".bias") else 1)
        if name.endswith("norm.weight"):  # scales as a trained head's norms: positive, around one
            assert (values >= 0.5).all() and (values <= 2).all(), name


@pytest.mark.parametrize("architecture", GGUF_SHAPES)
def test_a_tiny_gguf_stores_every_drawn_norm_and_bias(tmp_path, architecture):
    model = tiny_base(GGUF_SHAPES[architecture], GGUF_VOCAB)
    stored = {t.name: t.data for t in GGUFReader(tiny_gguf(architecture, tmp_path)).tensors
              if t.name.endswith(("norm.weight", ".bias"))}
    assert len(stored) == len(norms_and_biases(model))
    for name, values in stored.items():  # every family's file stores a norm as its scale (Gemma's w + 1)
        assert_drawn(name, values, 0 if name.endswith(".bias") else 1)
