"""What would break or crawl on a GPU, checked on the CPU: the head's attention kernel choice and dtype "auto"."""
import pytest
import torch
import torch.nn.functional as F

from engine.draft.layers import Attention, Rotary, attend
from engine.model.load import auto_dtype


def random_attention_inputs(heads: int, kv_heads: int, queries: int, keys: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, queries, 16, generator=generator)  # a batch of two, as in training
    k, v = (torch.randn(2, kv_heads, keys, 16, generator=generator) for _ in range(2))
    mask = torch.rand(1, 1, queries, keys, generator=generator) < 0.6
    mask[..., -1] = True  # every query sees at least itself
    return q, k, v, mask


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("queries,keys", [(1, 9), (8, 40), (33, 33)])
def test_attend_equals_grouped_sdpa(heads, kv_heads, queries, keys):
    q, k, v, mask = random_attention_inputs(heads, kv_heads, queries, keys)
    previous = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(attend(q, k, v, mask), previous, rtol=1e-6, atol=1e-6)
    causal = F.scaled_dot_product_attention(q, k, v, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(attend(q, k, v, None), causal, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1)])
def test_head_attention_never_asks_sdpa_for_a_mask_with_grouped_heads(monkeypatch, heads, kv_heads):
    """On CUDA that pair falls back to the math kernel, whose float32 [1, H, L, L] scores fill a 24 GB card."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, enable_gqa=False, **kwargs):
        calls.append((attn_mask is not None, enable_gqa))
        return sdpa(*args, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    attention = Attention(32, 48, heads, kv_heads).eval()
    rotary = Rotary(48 // heads, theta=10000.0)
    prompt = torch.randn(1, 20, 32)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()[None, None]
    _, past = attention(prompt, rotary(torch.arange(20), torch.float32), None, causal)  # a prompt commit
    tree = torch.cat([torch.ones(3, 20, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], dim=1)[None, None]
    attention(torch.randn(1, 3, 32), rotary(torch.full((3,), 20), torch.float32), past, tree)  # a tree level
    assert calls == [(True, False), (True, False)]
    attention(prompt, rotary(torch.arange(20), torch.float32), None, None)
    assert calls[-1] == (False, True), "without a mask the grouped kernels apply and keys need no copy"


@pytest.fixture
def fake_cuda(monkeypatch):
    def make(bf16: bool):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)

    return make


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:1"])
@pytest.mark.parametrize("quantization", ["none", "4bit", "8bit"])
def test_auto_dtype_on_a_gpu_is_16_bit(fake_cuda, device, quantization):
    fake_cuda(bf16=True)
    assert auto_dtype(device, quantization) == "bfloat16"
    fake_cuda(bf16=False)
    assert auto_dtype(device, quantization) == "float16"


def test_auto_dtype_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("engine.model.load.bf16_native", lambda: True)
    assert auto_dtype("cpu") == auto_dtype("auto") == "bfloat16"
    assert auto_dtype("cpu", pack=False) == auto_dtype("cpu", "4bit") == "float32"
    monkeypatch.setattr("engine.model.load.bf16_native", lambda: False)
    assert auto_dtype("cpu") == "float32"
