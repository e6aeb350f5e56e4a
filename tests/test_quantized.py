"""bitsandbytes 8-bit and 4-bit base models: EAGLE greedy output equals plain greedy decoding of the same
quantized model, the head stays in float beside the LM head, and missing optional packages are named."""
import sys
from contextlib import contextmanager

import pytest
import torch
from bitsandbytes.nn import Linear4bit, Linear8bitLt
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import VOCAB, IdsOnlyTokenizer, random_head, tokens_of
from engine import Engine
from engine.model.load import embedded_gguf_path, load_model

NEW_TOKENS = 50
QUANTIZED_LINEAR = {"8bit": (Linear8bitLt, torch.int8), "4bit": (Linear4bit, torch.uint8)}


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face checkpoint, which bitsandbytes quantizes while loading.

    Default-scale weights keep every linear input below LLM.int8's outlier threshold (checked below): above it,
    8-bit layers compute outlier columns chosen across all tokens of a forward, so their output depends on the
    other tokens in the batch and no decoder that batches tokens can match one-token-at-a-time decoding.
    """
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@contextmanager
def largest_linear_input(model):
    """Track the largest |input| any bitsandbytes 8-bit layer sees while the block runs."""
    seen = [0.0]

    def hook(module, args):
        seen[0] = max(seen[0], args[0].abs().max().item())

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, Linear8bitLt)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@pytest.fixture(scope="module", params=["8bit", "4bit"])
def quantized(request, base_folder):
    # float32 compute: on the CPU, bfloat16 rounding turns the tiny batch-size-dependent differences of any
    # kernel into argmax flips (quantized or not), which would hide what this file checks.
    model = load_model(str(base_folder), quantization=request.param, dtype="float32")
    model.generation_config.eos_token_id = None
    return request.param, model


def test_decoder_layers_are_quantized_and_the_lm_head_is_not(quantized):
    kind, model = quantized
    module_type, weight_dtype = QUANTIZED_LINEAR[kind]
    projections = [m for m in model.get_decoder().layers.modules() if isinstance(m, torch.nn.Linear)]
    assert projections and all(isinstance(m, module_type) and m.weight.dtype == weight_dtype for m in projections)
    assert model.get_output_embeddings().weight.dtype == torch.float32
    head = random_head(model, "eagle3")
    assert head.fc.weight.dtype == torch.float32
    assert head.fc.weight.device == model.get_output_embeddings().weight.device


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_eagle_greedy_equals_vanilla_of_the_quantized_model(quantized, kind, prompt):
    quantization, model = quantized
    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, kind))
    with largest_linear_input(model) as seen:
        vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
        steps = list(engine.generate(prompt, method="eagle", max_new_tokens=NEW_TOKENS))
    assert tokens_of(steps) == vanilla
    assert sum(s.accepted for s in steps) > 0, "no draft was accepted: the test would not exercise tree paths"
    if quantization == "8bit":
        assert 0 < seen[0] < model.config.quantization_config.llm_int8_threshold


def test_quantization_changes_the_model(quantized, base_folder, prompt):
    """The quantized model is really another function than the float one (else the tests above prove little)."""
    _, model = quantized
    reference = load_model(str(base_folder))
    ids = torch.tensor([prompt])
    assert not torch.equal(model(ids).logits, reference(ids).logits)


def test_missing_bitsandbytes_is_named(monkeypatch, base_folder):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(ImportError,
                       match=r"--quantization 4bit needs the package bitsandbytes.*pip install bitsandbytes"):
        load_model(str(base_folder), quantization="4bit")


def test_missing_flash_attn_is_named(monkeypatch, base_folder):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ImportError, match=r"flash_attention_2 needs the package flash_attn.*requirements-gpu\.txt"):
        load_model(str(base_folder), attn_implementation="flash_attention_2")


def test_flash_attention_is_refused_with_a_draft_head(tmp_path):
    with pytest.raises(ValueError, match="tree mask"):
        Engine.load(str(tmp_path), head=str(tmp_path), attn="flash_attention_2")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(quantization="3bit"), "unknown quantization '3bit'"),
        (dict(attn_implementation="flash"), "unknown attention 'flash'"),
        (dict(device="cuda:0"), "needs a CUDA GPU"),
        (dict(max_memory="10GiB"), "max_memory caps each GPU when device=.auto."),
    ],
)
def test_bad_options_are_refused_before_loading(base_folder, kwargs, message):
    if "device" in kwargs and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=message):
        load_model(str(base_folder), **kwargs)


def test_gguf_base_with_quantization_is_refused():
    with pytest.raises(ValueError, match="a GGUF file is loaded as it is"):
        load_model(str(embedded_gguf_path()), quantization="8bit")
