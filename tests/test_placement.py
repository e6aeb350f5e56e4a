"""`--device auto` placement with fake GPUs: layer split, memory caps, and where the draft head goes."""
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from engine.models import resolve_device
from engine.placement import device_map_for, head_device, module_bytes, plan_device_map, split_layers

GIB = 2**30
# A Llama-2-7B-shaped config: 32 layers of hidden 4096; built on the meta device, so it costs no memory.
LLAMA_7B = LlamaConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32,
)


def test_even_split_keeps_layers_contiguous_and_balanced():
    placement = split_layers([10] * 8, anchored_bytes=0, budgets={0: 100, 1: 100})
    assert placement == [0] * 4 + [1] * 4


def test_anchored_modules_shift_layers_to_the_first_device():
    # 80 bytes of layers + 40 anchored on the last device: 60 / 60 is the balance.
    placement = split_layers([10] * 8, anchored_bytes=40, budgets={0: 100, 1: 100})
    assert placement == [0] * 6 + [1] * 2


def test_memory_cap_moves_layers_to_the_other_device():
    placement = split_layers([10] * 8, anchored_bytes=0, budgets={0: 30, 1: 100})
    assert placement == [0] * 3 + [1] * 5


def test_three_devices_in_order():
    placement = split_layers([10] * 9, anchored_bytes=0, budgets={"cuda:0": 50, "cuda:1": 50, "cuda:2": 50})
    assert placement == ["cuda:0"] * 3 + ["cuda:1"] * 3 + ["cuda:2"] * 3


def test_a_tight_fit_still_fits():
    # Balance asks for 43 / 42, but device 1 has room for only 3 layers beside its 5 anchored bytes.
    placement = split_layers([10] * 8, anchored_bytes=5, budgets={0: 50, 1: 42})
    assert placement == [0] * 5 + [1] * 3


def test_too_large_a_model_is_refused_with_sizes():
    with pytest.raises(MemoryError, match=r"needs about .* GiB but the devices offer"):
        split_layers([GIB] * 10, anchored_bytes=GIB, budgets={0: 5 * GIB, 1: 5 * GIB})


def test_no_contiguous_split_is_refused():
    with pytest.raises(MemoryError, match="no contiguous split"):
        split_layers([40, 40, 40], anchored_bytes=0, budgets={0: 60, 1: 60})


def test_head_device_takes_the_most_specific_entry():
    device_map = {"": 0, "model.layers.31": 1, "lm_head": 1}
    assert head_device(device_map) == 1
    assert head_device({"": "cuda:0"}) == "cuda:0"
    assert head_device({"model": 0, "lm_head.weight": 1}, "lm_head.weight") == 1
    with pytest.raises(KeyError, match="lm_head"):
        head_device({"model": 0})


@pytest.mark.parametrize("quantization", ["none", "8bit", "4bit"])
def test_7b_over_two_24gb_gpus(quantization):
    budgets = {0: 20 * GIB, 1: 20 * GIB}
    device_map = plan_device_map(LLAMA_7B, torch.float16, quantization, budgets)
    layers = [device_map[f"model.layers.{i}"] for i in range(32)]
    assert layers == sorted(layers) and set(layers) == {0, 1}  # one boundary crossing per forward
    for module in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"):
        assert device_map[module] == 1
    assert head_device(device_map) == layers[-1] == 1
    assert 10 <= layers.count(0) <= 22


def test_quantized_layers_weigh_less():
    with torch.device("meta"):
        layer = torch.nn.Linear(4096, 4096, bias=False)
    full = module_bytes(layer, 2)
    assert module_bytes(layer, 2, "8bit") == full // 2
    assert full // 4 < module_bytes(layer, 2, "4bit") < full // 3


def test_7b_fp16_does_not_fit_one_capped_gpu():
    with pytest.raises(MemoryError, match="quantize it"):
        plan_device_map(LLAMA_7B, torch.float16, "none", {0: 10 * GIB})


def test_tied_embeddings_stay_with_the_lm_head():
    config = Qwen2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )
    device_map = plan_device_map(config, torch.float32, "none", {0: 10**6, 1: 10**6})
    assert device_map["model.embed_tokens"] == device_map["lm_head"] == 1
    assert {device_map[f"model.layers.{i}"] for i in range(6)} == {0, 1}


def test_device_map_covers_every_parameter():
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                             num_attention_heads=4, vocab_size=100))
    device_map = device_map_for(model, [0, 0, 1, 1])
    for name, _ in model.named_parameters():
        assert any(name == key or name.startswith(key + ".") for key in device_map), name
    with pytest.raises(ValueError, match="3 devices given for 4 decoder layers"):
        device_map_for(model, [0, 0, 1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_auto_device_without_gpus_is_the_cpu():
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="unknown device 'gpu:0'"):
        resolve_device("gpu:0")
