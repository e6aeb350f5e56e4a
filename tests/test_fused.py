"""engine.model.fused: a grouped decoder of each family it describes (Llama, Qwen2, Qwen3, Gemma 3) in one kernel
call gives the very bits transformers' forward gives, and a tree's rows the bits of one-token steps, past a sliding
window too."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from engine import Engine
from engine.model import kernels
from engine.draft.fused import FusedEagle3
from engine.model.fused import PROJECTIONS, FusedDecoder, why_not_fused
from engine.model.groups import quantize
from engine.model.quant import QuantLinear
from engine.decode.round import Sequence, verify
from engine.model.target import Target
from engine.draft.tree import DraftTree
from tests.conftest import (BRANCHING, VOCAB, IdsOnlyTokenizer, assert_fused_head_gives_its_modules_bits, random_head,
                            tiny_base, tokens_of)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="engine/model/kernels unavailable")
# One tiny model of each family; Gemma 3's slides over 32 tokens in all but one layer.
FAMILY_SHAPES = ["llama-h64-l8-gqa", "qwen2-h32-l10-tied", "qwen3-h64-l9", "gemma3-h64-l8-swa"]
# Longer than the sliding window: its rows see fewer keys than the global layers' rows.
LONG_PROMPT = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(8)).tolist()


def forwards(target: Target, prompt: list[int]) -> list[torch.Tensor]:
    """Prefill, two plain steps, then a tree of four nodes (two branches) with its mask and positions: every
    hidden state, feature and cached key and value they leave."""
    cache = target.new_cache()
    outputs = list(target.forward(torch.tensor(prompt), cache))
    for token in (5, 9):
        outputs += target.forward(torch.tensor([token]), cache)
    cached = cache.get_seq_length()
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, cached, dtype=torch.bool), visible], dim=1)
    outputs += target.forward(torch.tensor([3, 7, 8, 2]), cache, cached + torch.tensor([0, 1, 1, 2]), mask)
    outputs += [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
    return outputs


def assert_fused_equals_transformers(engine: Engine, prompt: list[int]) -> None:
    fused, reference = engine.target, Target(engine.model, engine.target.feature_layers, fused=False)
    assert fused.fused is not None and reference.fused is None
    for ours, theirs in zip(forwards(fused, prompt), forwards(reference, prompt), strict=True):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", [None, "eagle3"])
@pytest.mark.parametrize("kernels", ["q4", "int8"])
def test_a_tiny_q4_llama_fused_gives_transformers_bits(kind, kernels, prompt):
    model = tiny_base("llama-h64-l8-gqa")
    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, kind) if kind else None, pack=True, kernels=kernels)
    assert engine.target.fused.int8 == (kernels == "int8")
    assert_fused_equals_transformers(engine, prompt)


@pytest.mark.parametrize("kernels", ["q4", "int8"])
def test_the_embedded_model_fused_gives_transformers_bits(kernels):
    engine = Engine.load(kernels=kernels)
    prompt = engine.encode_chat([{"role": "user", "content": "Explain how a bicycle works, step by step."}])
    assert_fused_equals_transformers(engine, prompt)


@pytest.mark.parametrize("shape", FAMILY_SHAPES)
@pytest.mark.parametrize("kernels", ["q4", "int8"])
def test_each_family_fused_gives_transformers_bits(shape, kernels):
    """Qwen2's q, k, v biases, Qwen3's and Gemma 3's q and k norms, Gemma's norms after attention and the MLP, its
    GeGLU, embedding scale and its sliding layers' own rotary tables and window (the prompt is longer than it)."""
    model = tiny_base(shape)
    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, "eagle3"), pack=True, kernels=kernels)
    assert engine.target.fused is not None, why_not_fused(model)
    assert_fused_equals_transformers(engine, LONG_PROMPT)


def test_llama_3_rope_scaling_fused_gives_transformers_bits():
    """Llama 3.x's scaled rotary frequencies come in the tables the fused forward is handed."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    assert model.model.rotary_emb.rope_type == "llama3"
    engine = Engine.over(model, IdsOnlyTokenizer(), pack=True, kernels="int8")
    assert engine.target.fused is not None
    assert_fused_equals_transformers(engine, LONG_PROMPT)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
@pytest.mark.parametrize("shape", FAMILY_SHAPES)
def test_tree_rows_are_one_token_steps_bits_past_the_window(shape, fused):
    """A tree after a prompt longer than Gemma's window: each row's hidden state has the bits of the one-token step
    that decodes its path, through the fused forward and through transformers' (which is given the sliding layers'
    own mask: the tree's mask alone would let a row see keys its step does not)."""
    model = tiny_base(shape)
    engine = Engine.over(model, IdsOnlyTokenizer(), pack=True, kernels="int8")
    target = engine.target if fused else Target(engine.model, None, fused=False)
    assert (target.fused is not None) == fused
    tree = target.new_cache()
    target.forward(torch.tensor(LONG_PROMPT), tree)
    cached = tree.get_seq_length()
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, cached, dtype=torch.bool), visible], dim=1)
    rows, _ = target.forward(torch.tensor([3, 7, 8, 2]), tree, cached + torch.tensor([0, 1, 1, 2]), mask)
    for row, path in ((0, [3]), (1, [3, 7]), (2, [3, 8]), (3, [3, 8, 2])):
        steps = target.new_cache()
        target.forward(torch.tensor(LONG_PROMPT), steps)
        for token in path:
            hidden, _ = target.forward(torch.tensor([token]), steps)
        assert torch.equal(rows[row], hidden[0]), (row, path)


@pytest.mark.parametrize("kernels", ["q4", "int8"])
def test_a_tiny_gemma_3_decodes_losslessly_past_its_window(kernels):
    model = tiny_base("gemma3-h64-l8-swa")
    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, "eagle3"), pack=True, kernels=kernels)
    vanilla = tokens_of(engine.generate(LONG_PROMPT, method="vanilla", max_new_tokens=40))
    steps = list(engine.generate(LONG_PROMPT, method="eagle", max_new_tokens=40, **BRANCHING))
    assert tokens_of(steps) == vanilla and sum(s.accepted for s in steps) > 0


def test_models_it_does_not_describe_keep_transformers_forward():
    float_model = tiny_base("llama-h64-l8-gqa")
    engine = Engine.over(float_model, IdsOnlyTokenizer(), pack=True)
    assert engine.target.fused is None and "grouped layers" in why_not_fused(float_model)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    assert "model type 'mistral'" in why_not_fused(mistral)


@pytest.mark.parametrize("kernels", ["q4", "int8"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_eagle3_heads_layer_fused_gives_its_modules_bits(kernels, kind):
    """The fused head gives its modules' bits (conftest's check), the engine's head (Q4_1, fc Q8_0) and one all in
    Q8_0, the embedding looked up before the call (a float table)."""
    model = tiny_base("llama-h64-l8-gqa")
    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, "eagle3"), pack=True, kernels=kernels)
    for parent in list(engine.head.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear) and child.kind != kind:
                setattr(parent, name, QuantLinear(quantize(child.dequantized(), kind), None, child.int8))
    assert engine.head.midlayer.mlp.down_proj.kind == engine.head.lm_head.kind == kind
    assert_fused_head_gives_its_modules_bits(engine, VOCAB, int8=kernels == "int8")


MISNAMED = {("query" if name == "q" else name): path for name, path in PROJECTIONS.items()}  # q's weights as query.*


@pytest.mark.parametrize("kernels", ["q4", "int8"])
def test_the_decoder_refuses_a_misshaped_or_misnamed_weight_by_its_name_and_layer(kernels, monkeypatch):
    """The Decoder checks its weights once, as it is built: one a feature (q4) or a tile (int8) short, or one under a
    name the kernels do not know, is refused there, the error naming the weight and its layer; and so is a dimension
    the Decoder does not take."""
    engine = Engine.over(tiny_base("qwen3-h64-l9"), IdsOnlyTokenizer(), pack=True, kernels=kernels)
    assert engine.target.fused is not None
    projection = engine.model.model.layers[3].self_attn.k_proj
    scales = projection.scales
    projection.scales = scales[:-1]
    with pytest.raises(RuntimeError, match=r"decoder layer 3: weight 'k\.scales' is .+, expected"):
        FusedDecoder(engine.model)
    projection.scales = scales
    monkeypatch.setattr("engine.model.fused.PROJECTIONS", MISNAMED)
    with pytest.raises(RuntimeError, match=r"decoder layer 0: no weight is named 'query\.codes'"):
        FusedDecoder(engine.model)
    with pytest.raises(RuntimeError, match=r"decoder: no dimension is named 'hiden'"):
        torch.classes.eagle_cpu.Decoder({"hiden": 64}, 1e-6, 1.0, False, True, [], {})


@pytest.mark.parametrize("kernels", ["q4", "int8"])
def test_the_eagle3_head_refuses_a_misshaped_or_misnamed_weight_by_its_name(kernels, monkeypatch):
    """As the Decoder: the fused head's fc a feature or a tile short, or its q projection's weights misnamed, are
    refused as it is built, by name."""
    model = tiny_base("llama-h64-l8-gqa")
    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, "eagle3"), pack=True, kernels=kernels)
    assert FusedEagle3.of(engine.head) is not None
    fc = engine.head.fc
    scales = fc.scales
    fc.scales = scales[:-1]
    with pytest.raises(RuntimeError, match=r"EAGLE-3 head: weight 'fc\.scales' is .+, expected"):
        FusedEagle3(engine.head)
    fc.scales = scales
    monkeypatch.setattr("engine.model.fused.PROJECTIONS", MISNAMED)
    with pytest.raises(RuntimeError, match=r"EAGLE-3 head: no weight is named 'query\.codes'"):
        FusedEagle3(engine.head)


@pytest.mark.parametrize("kernels", ["float", "int8"])
def test_a_chain_verified_causally_gives_the_bits_of_its_tree_mask(kernels, prompt):
    """verify() scores a chain (each node the child of the one before, as every tree of the CPU default is) with the
    forward's own causal mask and positions: its rows see the very keys the tree's mask shows them, so they come out
    with the same bits, on the fused int8 forward and on transformers' (float32, the fixed-order attention)."""
    engine = Engine.over(tiny_base("llama-h64-l8-gqa"), IdsOnlyTokenizer(), pack=True, kernels=kernels)
    assert (engine.target.fused is not None) == (kernels == "int8")
    chain = DraftTree(torch.tensor([3, 7, 8]), torch.tensor([-1, 0, 1]))
    assert chain.is_chain and not DraftTree(torch.tensor([3, 7, 8]), torch.tensor([-1, 0, 0])).is_chain
    scored = []
    for causal in (True, False):
        seq = Sequence(len(prompt), engine.target.new_cache(), produced=1)
        engine.target.forward(torch.tensor(prompt), seq.cache)
        chain.is_chain = causal  # False: the tree path, its mask and positions built
        verification = verify(engine.target, chain, seq)
        scored.append((verification.logits, verification.features, seq.cache.layers[0].keys))
    for ours, theirs in zip(*scored):
        assert torch.equal(ours, theirs)


RMS_NORM_CHECK = """
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from engine.model import kernels
assert kernels.available()
generator = torch.Generator().manual_seed(0)
for width in (576, 1536, 64, 5, 17, 100, 3000, 20000, 70000):
    norm = LlamaRMSNorm(width, eps=1e-5)
    norm.weight.data = torch.randn(width, generator=generator)
    for scale in (1e-3, 1.0, 1e4):
        x = torch.randn(8, width, generator=generator) * scale
        x[0] *= torch.rand(width, generator=generator) * 100
        assert torch.equal(torch.ops.eagle_cpu.rms_norm(x, norm.weight.data, 1e-5), norm(x)), (width, scale)
print(torch.backends.cpu.get_cpu_capability(), torch.ops.eagle_cpu.torch_sum_lanes())
"""


@pytest.mark.parametrize("capability", [None, "avx2"])
def test_rms_norm_sums_as_torch_does(capability):
    """The fused forward's RMSNorm sums each row's squares by hand in torch's own order (not through a torch call
    per norm): transformers' bits for rows short and long (the cascade of chunks), small and large, with torch
    dispatching to AVX2 code or to what this CPU offers beyond it, in a fresh process for each."""
    env = dict(os.environ, **({"ATEN_CPU_CAPABILITY": capability} if capability else {}))
    done = subprocess.run([sys.executable, "-c", RMS_NORM_CHECK], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    lanes = int(done.stdout.split()[-1])
    assert lanes in (8, 16), "torch 2.13's sum order was recognised (0: rms_norm fell back to torch's mean)"
