"""A user's GGUF of any supported architecture and tensor type on the fast exact path: every projection on the int8
kernels with the file's own groups (float matrices rounded to Q8_0), the decoder in one kernel call, and greedy
EAGLE, context drafting and plain decoding giving the same tokens, with tree rows the bits of one-token steps."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from conftest import BRANCHING, assert_fused_head_gives_its_modules_bits, random_head, tokens_of
from engine import Engine
from engine.draft.drafter import Drafter
from engine.model import gguf_tensors, kernels
from engine.model.gguf_tensors import GgufFile
from engine.model.load import load_base
from engine.model.quant import QuantLinear
from engine.testing import tiny_gguf
from engine.testing.tiny import tiny_base
from engine.testing.tiny_gguf import GGUF_VOCAB, write_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"engine/model/kernels: {kernels.unavailable_reason()}")
WIDE = {"llama": "llama-h256-l3", "qwen2": "qwen2-h256-l3", "gemma3": "gemma3-h256-l6-swa"}
# What llama.cpp's Q4_K_M mix gives a layer: Q4_K, with v and down (and the embedding) in Q6_K.
Q4_K_M = {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}
FLOATS = ("F16", "BF16", "F32")
# Past Gemma's 32-token window.
PROMPT = torch.randint(0, GGUF_VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def grouped_engine(path, head: bool = True) -> Engine:
    model, tokenizer = load_base(str(path))
    return Engine.over(model, tokenizer, random_head(model, "eagle3") if head else None, pack=True, kernels="int8",
                       gguf=GgufFile.open(path))


def assert_tree_rows_are_one_token_steps(engine: Engine) -> None:
    target = engine.target
    tree = target.new_cache()
    target.forward(torch.tensor(PROMPT), tree)
    cached = tree.get_seq_length()
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, cached, dtype=torch.bool), visible], dim=1)
    rows, _ = target.forward(torch.tensor([3, 7, 8]), tree, cached + torch.tensor([0, 1, 1]), mask)
    for row, path in ((0, [3]), (1, [3, 7]), (2, [3, 8])):
        steps = target.new_cache()
        target.forward(torch.tensor(PROMPT), steps)
        for token in path:
            hidden, _ = target.forward(torch.tensor([token]), steps)
        assert torch.equal(rows[row], hidden[0]), (row, path)


CASES = [("llama", kind) for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", *FLOATS)]
CASES += [("llama", "Q4_K_M"), ("qwen2", "Q4_K_M"), ("gemma3", "Q4_K_M"), ("gemma3", "Q5_0")]


@pytest.mark.parametrize("architecture, kind", CASES)
def test_a_gguf_of_each_type_decodes_losslessly_on_the_fast_path(tmp_path, monkeypatch, architecture, kind):
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    types = Q4_K_M if kind == "Q4_K_M" else kind
    path = write_gguf(tiny_base(WIDE[architecture], GGUF_VOCAB), tmp_path / f"{architecture}-{kind}.gguf", types)
    engine = grouped_engine(path)
    assert engine.target.fused is not None
    projections = [m for layer in engine.model.get_decoder().layers for m in layer.modules()
                   if isinstance(m, QuantLinear)]
    assert len(projections) == 7 * len(engine.model.get_decoder().layers) and all(m.int8 for m in projections)
    expected = {"Q4_K", "Q6_K"} if kind == "Q4_K_M" else {"Q8_0"} if kind in FLOATS else {kind}
    assert {m.kind for m in projections} == expected
    assert_tree_rows_are_one_token_steps(engine)
    vanilla = tokens_of(engine.generate(PROMPT, method="vanilla", max_new_tokens=40))
    assert tokens_of(engine.generate(PROMPT, method="suffix", max_new_tokens=40)) == vanilla
    assert tokens_of(engine.generate(PROMPT, method="eagle", max_new_tokens=40, **BRANCHING)) == vanilla


def test_the_embedding_is_read_from_the_files_groups(tmp_path, monkeypatch):
    """No float table is kept: the rows looked up are the file's groups dequantized, Gemma's scale on them."""
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_base(WIDE["gemma3"], GGUF_VOCAB), tmp_path / "gemma.gguf", Q4_K_M)
    float_model, _ = load_base(str(path))
    reference = float_model.get_input_embeddings()(torch.tensor([[0, 5, 319]]))
    engine = grouped_engine(path, head=False)
    table = engine.model.get_input_embeddings()
    assert table.weight.numel() == 0 and torch.equal(table(torch.tensor([[0, 5, 319]])), reference)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_the_fused_head_reads_the_files_embedding_with_its_modules_bits(tmp_path, monkeypatch, architecture):
    """On a GGUF base the fused head looks its token rows up in the file's groups itself (Gemma's scale on them) and
    drafts with the bits of the head's modules."""
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_base(WIDE[architecture], GGUF_VOCAB), tmp_path / f"{architecture}.gguf", Q4_K_M)
    engine = grouped_engine(path)
    assert Drafter(engine.head).fused.table  # the table's groups, not rows looked up before the call
    assert_fused_head_gives_its_modules_bits(engine, GGUF_VOCAB, int8=True)


@pytest.mark.parametrize("architecture, kind", [("llama", "Q4_K_M"), ("qwen2", "Q4_K_M"), ("gemma3", "Q4_K_M"),
                                                ("llama", "F16"), ("gemma3", "Q4_0")])
def test_a_model_built_from_the_files_blocks_is_the_one_transformers_loading_gives(tmp_path, monkeypatch,
                                                                                 architecture, kind):
    """Engine.load builds a grouped GGUF base straight from the file (no float32 copy): every tensor and every
    decoded token as through transformers' dequantizing load followed by quantize_linears."""
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    types = Q4_K_M if kind == "Q4_K_M" else kind
    path = write_gguf(tiny_base(WIDE[architecture], GGUF_VOCAB), tmp_path / f"{architecture}-{kind}.gguf", types)
    direct = Engine.load(str(path), head=None, corpus=None)
    reference = grouped_engine(path, head=False)
    assert not any(isinstance(m, torch.nn.Linear) for m in direct.model.modules())
    ours = {**dict(direct.model.named_parameters()), **dict(direct.model.named_buffers())}
    theirs = {**dict(reference.model.named_parameters()), **dict(reference.model.named_buffers())}
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    ids = direct.encode_text("the sea and the moon")
    assert tokens_of(direct.generate(ids, method="vanilla", max_new_tokens=30)) == \
        tokens_of(reference.generate(ids, method="vanilla", max_new_tokens=30))


def counted_table_reads(monkeypatch) -> list:
    """The files whose tensor table gguf_tensors.read_tensors reads from now on, one entry a reading."""
    reads, read = [], gguf_tensors.read_tensors
    monkeypatch.setattr(gguf_tensors, "read_tensors", lambda path: reads.append(path) or read(path))
    return reads


@pytest.mark.parametrize("kernels", ["int8", "float"])
def test_a_load_reads_the_files_tensor_table_once(tmp_path, monkeypatch, kernels):
    """Engine.load opens the GGUF once and passes it on: on the fast path (built from the file's blocks, the
    tokenizer, the description) and on transformers' float path alike, the table is read once."""
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_base(WIDE["llama"], GGUF_VOCAB), tmp_path / "llama.gguf", Q4_K_M)
    reads = counted_table_reads(monkeypatch)
    engine = Engine.load(str(path), head=None, corpus=None, kernels=kernels)
    assert engine.kernels == kernels and (engine.target.fused is not None) == (kernels == "int8")
    assert engine.description().tensor_types == {"Q4_K": 16, "Q6_K": 7, "F32": 7}  # 3 layers, the output in Q4_K
    assert reads == [path]


def test_a_type_the_kernels_do_not_read_keeps_its_layer_on_the_float_path(tmp_path, monkeypatch, caplog):
    """A Q2_K matrix among Q8_0 ones: that layer runs dequantized in float32, the rest on the int8 kernels, the log
    says so, and decoding stays exact."""
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    encode = tiny_gguf.quantize_blocks

    def with_q2_k(weights, kind):  # random valid Q2_K blocks: 16 packed scales, 64 bytes of codes, d, dmin
        if kind != "Q2_K":
            return encode(weights, kind)
        rng = np.random.default_rng(0)
        raw = rng.integers(0, 256, size=(weights.shape[0], weights.shape[1] // 256, 84), dtype=np.uint8)
        raw[..., 80:84] = np.array([0.01, 0.005], dtype=np.float16).view(np.uint8)
        return raw.reshape(weights.shape[0], -1)

    monkeypatch.setattr(tiny_gguf, "quantize_blocks", with_q2_k)
    path = write_gguf(tiny_base(WIDE["llama"], GGUF_VOCAB), tmp_path / "q2k.gguf",
                      {"default": "Q8_0", "blk.1.ffn_down.weight": "Q2_K"})
    reads = counted_table_reads(monkeypatch)
    with caplog.at_level(logging.INFO):
        engine = Engine.load(str(path), head=None, corpus=None)
    assert reads == [path]  # the float copy's groups matched from the one table read
    assert "1 Q2_K tensors, which the int8 kernels do not read" in caplog.text
    layers = engine.model.get_decoder().layers
    assert not isinstance(layers[1].mlp.down_proj, QuantLinear) and isinstance(layers[0].mlp.down_proj, QuantLinear)
    assert engine.target.fused is None and "grouped" in engine.description().lines()[-1]
    assert_tree_rows_are_one_token_steps(engine)
