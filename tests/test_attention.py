"""The CPU engine's attentions (float64 `wide`, float32 `fixed_order` from engine/model/kernels): the same results as SDPA,
and rows that do not depend on what shares their forward."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import PACKED_DTYPES, IdsOnlyTokenizer
from engine import Engine
from engine.model import kernels
from engine.model.attention import FIXED_ORDER, NAME, fixed_order_attention, wide_attention
from engine.model.cache import truncate
from engine.model.packed import packing_available

NEEDS_KERNELS = pytest.mark.skipif(not kernels.available(), reason=f"engine/model/kernels: {kernels.unavailable_reason()}")
# (attention, dtype): the float64 attention takes any dtype; the fixed-order one float32.
ATTENTIONS = [(wide_attention, torch.float32), (wide_attention, torch.bfloat16),
              pytest.param(fixed_order_attention, torch.float32, marks=NEEDS_KERNELS)]


class GroupedAttention(torch.nn.Module):
    num_key_value_groups = 3


def _qkv(rows: int, length: int, dtype: torch.dtype, heads: int = 9, kv_heads: int = 3, dim: int = 64):
    torch.manual_seed(0)
    return (
        torch.randn(1, heads, rows, dim, dtype=dtype),
        torch.randn(1, kv_heads, length, dim, dtype=dtype),
        torch.randn(1, kv_heads, length, dim, dtype=dtype),
    )


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize("attention,dtype", ATTENTIONS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_attention_computes_what_sdpa_does(attention, dtype, mask_kind):
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    q, k, v = _qkv(rows=5, length=40, dtype=dtype)
    visible = torch.rand(5, 40, generator=torch.Generator().manual_seed(1)) < 0.6
    visible[:, 0] = True
    mask = {"none": None, "bool": visible[None, None], "additive": _additive(visible, dtype)}[mask_kind]
    out, _ = attention(GroupedAttention(), q, k, v, mask, scaling=0.1)
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else visible[None, None], scale=0.1, is_causal=mask is None,
        enable_gqa=True,
    )
    if mask is None:  # causal, aligned to the end of the keys (new queries after a cache)
        causal = torch.ones(5, 40, dtype=torch.bool).tril(35)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal[None, None], scale=0.1, enable_gqa=True)
    assert out.shape == (1, 5, 9, 64) and out.dtype == dtype
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("attention,dtype", ATTENTIONS)
@pytest.mark.parametrize("prefix,rows", [(300, 12), (1000, 70)])
def test_rows_do_not_depend_on_batch_or_key_layout(attention, dtype, prefix, rows):
    """One query at a time over a growing cache (decoding) vs all at once vs a tree layout with masked nodes between
    the path's keys: the same bits. torch's SDPA fails this on the same tensors. (1000, 70): the kernel scores the
    keys in several stretches and takes the rows in two blocks."""
    q, k, v = _qkv(rows, prefix + rows, dtype)
    attn = GroupedAttention()
    one_by_one = torch.cat([
        attention(attn, q[:, :, i : i + 1], k[:, :, : prefix + i + 1], v[:, :, : prefix + i + 1], None)[0]
        for i in range(rows)
    ], dim=1)
    together, _ = attention(attn, q, k, v, None)
    assert torch.equal(together, one_by_one)
    # The same path as nodes of a 2*rows tree: path node i at slot 2i+1, a masked sibling at 2i.
    slots = torch.arange(rows) * 2 + 1
    k_tree, v_tree = (torch.cat([x[:, :, :prefix], torch.randn(1, 3, 2 * rows, 64, dtype=dtype)], 2) for x in (k, v))
    k_tree[:, :, prefix + slots], v_tree[:, :, prefix + slots] = k[:, :, prefix:], v[:, :, prefix:]
    visible = torch.zeros(rows, prefix + 2 * rows, dtype=torch.bool)
    visible[:, :prefix] = True
    for i in range(rows):
        visible[i, prefix + slots[: i + 1]] = True
    in_tree, _ = attention(attn, q, k_tree, v_tree, _additive(visible, dtype))
    assert torch.equal(in_tree, one_by_one)


@NEEDS_KERNELS
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 96), (4, 2, 40), (6, 1, 64)])
def test_a_query_head_does_not_depend_on_the_heads_beside_it(heads, kv_heads, dim):
    """The kernel takes the query heads of a key/value head up to three at a time (three, two or one, and a head
    dimension split in passes of 32 or 8 values): each head alone gives the bits it gives among the others."""
    q, k, v = _qkv(rows=3, length=37, dtype=torch.float32, heads=heads, kv_heads=kv_heads, dim=dim)
    visible = torch.rand(3, 37, generator=torch.Generator().manual_seed(1)) < 0.7
    visible[:, 0] = True
    mask = _additive(visible, torch.float32)
    together, _ = fixed_order_attention(None, q, k, v, mask)
    group = heads // kv_heads
    for h in range(heads):
        g = slice(h // group, h // group + 1)
        alone, _ = fixed_order_attention(None, q[:, h : h + 1], k[:, g], v[:, g], mask)
        assert torch.equal(alone[:, :, 0], together[:, :, h]), h


@NEEDS_KERNELS
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 96), (6, 1, 40)])
def test_the_avx512_attention_gives_the_8_lane_paths_bits(heads, kv_heads, dim):
    """Keys two to a 16-lane vector for the scores, 16 output dimensions a vector for the values, 16 exponentials at
    a time, each lane the 8-lane path's operations: the same bits on a CPU with AVX-512 as on one with AVX2 alone,
    for visible-key counts that leave every remainder of 4, 8 and 16, over several stretches of keys."""
    if not torch.ops.eagle_cpu.set_wide(True):
        pytest.skip("this CPU has no AVX-512 (avx512f and avx512dq): the 8-lane path is the only one")
    q, k, v = _qkv(rows=19, length=700, dtype=torch.float32, heads=heads, kv_heads=kv_heads, dim=dim)
    visible = torch.rand(19, 700, generator=torch.Generator().manual_seed(2)) < 0.8
    for i in range(19):  # at least 680 - 13 i keys: every remainder
        visible[i, : 680 - 13 * i] = True
    visible[3] = False  # a row that sees nothing
    try:
        for mask in (None, _additive(visible, torch.float32)):
            wide, _ = fixed_order_attention(None, q, k, v, mask)
            torch.ops.eagle_cpu.set_wide(False)
            narrow, _ = fixed_order_attention(None, q, k, v, mask)
            torch.ops.eagle_cpu.set_wide(True)
            assert torch.equal(wide, narrow)
    finally:
        torch.ops.eagle_cpu.set_wide(True)


@NEEDS_KERNELS
@pytest.mark.parametrize("wide", [True, False])
def test_float16_keys_and_values_give_the_bits_of_their_float32_values(wide):
    """The engine's KV cache keeps float16 (engine/model/cache.py): the kernel widens each key and value exactly, so it
    attends as it would over float32 tensors holding the same rounded values, on either path, with or without mask."""
    if wide and not torch.ops.eagle_cpu.set_wide(True):
        pytest.skip("this CPU has no AVX-512 (avx512f and avx512dq)")
    q, k, v = _qkv(rows=5, length=613, dtype=torch.float32)
    k, v = k.half(), v.half()
    visible = torch.rand(5, 613, generator=torch.Generator().manual_seed(3)) < 0.7
    try:
        torch.ops.eagle_cpu.set_wide(wide)
        for mask in (None, _additive(visible, torch.float32)):
            half, _ = fixed_order_attention(None, q, k, v, mask)
            widened, _ = fixed_order_attention(None, q, k.float(), v.float(), mask)
            assert torch.equal(half, widened)
        with pytest.raises(RuntimeError, match="keys and values of one dtype"):
            fixed_order_attention(None, q, k, v.float(), None)
    finally:
        torch.ops.eagle_cpu.set_wide(True)


def _small_engine(dtype: torch.dtype, kernels: str) -> Engine:
    """Big enough for oneDNN's one-row kernel to round differently from its batched one (intermediate 1536)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=192, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    return Engine.over(model, IdsOnlyTokenizer(), pack=True, kernels=kernels)


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")
@pytest.mark.parametrize("dtype,kernel_choice", [(torch.float32, "float"), pytest.param(
    torch.bfloat16, "float", marks=PACKED_DTYPES[1].marks), pytest.param(torch.float32, "q4", marks=NEEDS_KERNELS),
    pytest.param(torch.float32, "int8", marks=NEEDS_KERNELS)])
def test_packed_cpu_forward_scores_a_tree_exactly_as_decoding_does(dtype, kernel_choice):
    engine = _small_engine(dtype, kernel_choice)
    assert engine.kernels == kernel_choice and engine.batch_invariant
    expected = FIXED_ORDER if dtype == torch.float32 and kernels.available() else NAME
    assert engine.model.config._attn_implementation == expected
    target, cache = engine.target, engine.target.new_cache()
    prefix = 200
    target.forward(torch.randint(0, 256, (prefix,)), cache)
    path = torch.randint(0, 256, (8,))
    decoded = []
    for i in range(len(path)):
        hidden, _ = target.forward(path[i : i + 1], cache)
        decoded.append(target.logits(hidden[-1]))
    truncate(cache, prefix)
    # The path inside a 16-node tree whose other nodes it does not see.
    slots = torch.tensor([0, 2, 3, 6, 7, 9, 12, 15])
    tokens, depths = torch.randint(0, 256, (16,)), torch.zeros(16, dtype=torch.long)
    tokens[slots], depths[slots] = path, torch.arange(8)
    visible = torch.zeros(16, prefix + 16, dtype=torch.bool)
    visible[:, :prefix] = True
    visible[torch.arange(16), prefix + torch.arange(16)] = True
    for i, slot in enumerate(slots):
        visible[slot, prefix + slots[: i + 1]] = True
    hidden, _ = target.forward(tokens, cache, prefix + depths, visible)
    assert torch.equal(target.logits(hidden[slots]), torch.stack(decoded))
