"""`--device auto` placement with fake GPUs: layer split, memory caps, and where the draft head goes."""
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from engine.model import load as loading
from engine.model.load import load_model, resolve_device
from engine.model.placement import (
    HEADROOM,
    device_map_for,
    gpu_budgets,
    head_device,
    model_bytes,
    module_bytes,
    plan_device_map,
    split_layers,
)

GIB = 2**30
# A Llama-2-7B-shaped config: 32 layers of hidden 4096; built on the meta device, so it costs no memory.
LLAMA_7B = LlamaConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32,
)
LLAMA_31_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8,
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


def test_7b_over_two_gpus_when_one_cannot_hold_it():
    budgets = {0: 10 * GIB, 1: 10 * GIB}  # a 7B model in fp16 needs ~13.5 GiB
    device_map = plan_device_map(LLAMA_7B, torch.float16, "none", budgets)
    layers = [device_map[f"model.layers.{i}"] for i in range(32)]
    assert layers == sorted(layers) and set(layers) == {0, 1}  # one boundary crossing per forward
    for module in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"):
        assert device_map[module] == 1
    assert head_device(device_map) == layers[-1] == 1
    assert 10 <= layers.count(0) <= 22


@pytest.mark.parametrize("dtype,quantization", [(torch.bfloat16, "none"), (torch.bfloat16, "4bit"),
                                                (torch.float16, "8bit")])
def test_a_model_that_fits_one_gpu_stays_on_the_first(dtype, quantization):
    budgets = {0: 20 * GIB, 1: 20 * GIB}  # two 24 GB cards, less headroom
    device_map = plan_device_map(LLAMA_31_8B, dtype, quantization, budgets)
    assert device_map == {"": 0} and head_device(device_map) == 0


def test_float32_8b_is_split_over_two_24gb_gpus():
    device_map = plan_device_map(LLAMA_31_8B, torch.float32, "none", {0: 20 * GIB, 1: 20 * GIB})
    assert {device_map[f"model.layers.{i}"] for i in range(32)} == {0, 1}


@pytest.mark.parametrize("quantization,gib", [("none", 15.4), ("4bit", 5.7)])
def test_model_bytes_of_llama_31_8b(quantization, gib):
    # 8.03 B parameters, 2 bytes each = 14.96 GiB, + one bf16 layer (0.22 B) reserved for the draft head. In 4-bit the
    # 6.98 B layer weights take 0.516 bytes (3.35 GiB), the embedding and LM head (1.05 B) stay bf16 (1.96 GiB).
    assert model_bytes(LLAMA_31_8B, torch.bfloat16, quantization) / GIB == pytest.approx(gib, abs=0.2)


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


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend torch sees `count` CUDA GPUs with `free` bytes each; returns a setter."""
    def make(count: int, free: int = 24 * GIB):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, free))

    return make


@pytest.fixture
def loads(monkeypatch):
    """Record from_pretrained's arguments instead of loading onto GPUs this machine does not have."""
    calls = []

    def record(name, **kwargs):
        calls.append(kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.5 GiB free.")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", staticmethod(record))
    return calls


@pytest.fixture
def llama_8b_folder(tmp_path):
    LLAMA_31_8B.save_pretrained(tmp_path)  # config.json only: planning reads no weights
    return str(tmp_path)


def test_gpu_budgets_are_free_memory_less_headroom_capped(fake_gpus):
    fake_gpus(2, free=24 * GIB)
    assert gpu_budgets() == {0: int(24 * GIB * (1 - HEADROOM)), 1: int(24 * GIB * (1 - HEADROOM))}
    assert gpu_budgets("10GiB") == {0: 10 * GIB, 1: 10 * GIB}
    assert gpu_budgets("10GiB", [1]) == {1: 10 * GIB}


@pytest.mark.parametrize("gpus", [1, 2])
def test_auto_puts_a_model_that_fits_on_the_first_gpu(fake_gpus, loads, llama_8b_folder, gpus):
    fake_gpus(gpus)
    with pytest.raises(MemoryError):
        load_model(llama_8b_folder, dtype="bfloat16", device="auto")
    assert loads[0]["device_map"] == {"": 0}


def test_an_explicit_gpu_is_planned_alone(fake_gpus, loads, llama_8b_folder):
    fake_gpus(2)
    with pytest.raises(MemoryError):
        load_model(llama_8b_folder, dtype="bfloat16", device="cuda:1")
    assert loads[0]["device_map"] == {"": 1}


def test_max_memory_is_honoured_with_one_gpu(fake_gpus, loads, llama_8b_folder):
    fake_gpus(1)
    with pytest.raises(MemoryError, match=r"needs about 15.36 GiB but the devices offer 12.00 GiB \(0: 12.00 GiB\)"):
        load_model(llama_8b_folder, dtype="bfloat16", device="auto", max_memory="12GiB")
    assert loads == [], "refused before loading anything"


def test_float32_8b_on_one_24gb_gpu_is_refused_before_loading(fake_gpus, loads, llama_8b_folder):
    fake_gpus(1)
    with pytest.raises(MemoryError, match="quantize it"):
        load_model(llama_8b_folder, dtype="float32", device="auto")
    assert loads == []


def test_running_out_of_gpu_memory_while_loading_is_explained(fake_gpus, loads, llama_8b_folder):
    fake_gpus(1)
    with pytest.raises(MemoryError) as error:
        load_model(llama_8b_folder, dtype="bfloat16", device="auto")
    message = str(error.value)
    assert "ran out of GPU memory" in message and "needs about 15.4 GiB (bfloat16, quantization none" in message
    for advice in ("--quantization 4bit", "--max-memory", "a smaller model", "Tried to allocate 2.00 GiB"):
        assert advice in message
    assert isinstance(error.value.__cause__, torch.OutOfMemoryError)
