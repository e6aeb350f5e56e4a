"""Batched self-distillation (engine.train.generation): every reply of a batch is the engine's own plain greedy
decoding of that prompt alone, token for token, on tiny random models and on the real embedded model."""
from __future__ import annotations

import itertools

import pytest
import torch

from conftest import PACKED_DTYPES, SHAPES, IdsOnlyTokenizer, tiny_base, tokens_of
from engine import Engine
from engine.model.target import Target
from engine.model.load import load_base
from engine.train.data import encode_prompt, first_prompt, read_conversations, stop_ids
from engine.train import generation
from engine.train.features import target_features
from engine.train.generation import (
    BatchGenerator,
    SlotCache,
    additive_mask,
    generate_replies,
    grouped_attention,
    load_generation_model,
    prepare_model,
    slots_that_fit,
)

STOPS = [5, 6]  # frequent in these random models' output: replies end at many lengths


def plain_greedy(engine: Engine, prompt: list[int], max_new_tokens: int) -> list[int]:
    return tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=max_new_tokens))


def random_prompts(count: int, longest: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, 16, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_row_of_a_batch_equals_plain_greedy_decoding(shape, dtype):
    engine_model, model = tiny_base(shape, dtype=dtype), tiny_base(shape, dtype=dtype)  # the same weights
    engine_model.generation_config.eos_token_id = STOPS
    engine = Engine.over(engine_model, IdsOnlyTokenizer(), pack=True)
    prompts = random_prompts(13, 40)
    expected = [plain_greedy(engine, p, 24) for p in prompts]
    assert len({len(e) for e in expected}) > 3  # rows end at different steps, and their slots are refilled
    prepare_model(model)
    replies = dict(generate_replies(model, prompts, STOPS, 24, slots=4))
    assert [replies[i] for i in range(len(prompts))] == expected


def test_prompts_prefilled_in_groups_within_the_token_budget_reply_alike():
    model = tiny_base("qwen3-h64-l9")
    prepare_model(model)
    prompts = random_prompts(13, 40, seed=3)
    together = dict(generate_replies(model, prompts, STOPS, 12, slots=13))
    grouped = BatchGenerator(model, prompts, STOPS, 12, slots=13, prefill_tokens=45)  # one to a few prompts each
    assert dict(grouped) == together


def test_slots_that_wait_for_one_another_before_a_prefill_reply_alike():
    model = tiny_base("llama-h64-l8-gqa")
    prepare_model(model)
    prompts = random_prompts(17, 30, seed=4)
    alone = dict(generate_replies(model, prompts, STOPS, 16, slots=5))
    waiting = BatchGenerator(model, prompts, STOPS, 16, slots=5, refill=3)
    live = []  # rows decoded while prompts were still waiting
    step = waiting.decode_step
    waiting.decode_step = lambda: (waiting.queue and live.append(int((waiting.owner >= 0).sum()))) or step()
    assert dict(waiting) == alone
    assert {3, 4} & set(live) and min(live) >= 3  # one or two free slots waited for a third, never more


def test_grouped_attention_equals_sdpa_with_keys_repeated_per_query_head():
    model = tiny_base("llama-h64-l8-gqa")
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    assert heads > kv_heads
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, heads, 5, 16, generator=generator)
    key, value = (torch.randn(3, kv_heads, 9, 16, generator=generator) for _ in range(2))
    visible = torch.rand(3, 5, 9, generator=generator) < 0.7
    visible[..., 0] = True
    mask = additive_mask(visible, torch.float32, torch.device("cpu"))
    out, _ = grouped_attention(None, query, key, value, mask, scaling=0.25)
    repeat = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_a_model_with_grouped_attention_replies_as_it_does_with_sdpa():
    model = tiny_base("llama-h64-l8-gqa")
    prompts = random_prompts(9, 30, seed=5)
    with_sdpa = dict(generate_replies(model, prompts, STOPS, 12, slots=4))
    model.set_attn_implementation(generation.GROUPED_ATTENTION)
    assert dict(generate_replies(model, prompts, STOPS, 12, slots=4)) == with_sdpa


def test_replies_come_as_rows_end_and_each_ends_at_its_first_stop():
    model = tiny_base("llama-h64-l8-gqa")
    prepare_model(model)
    prompts = random_prompts(9, 30, seed=1)
    order = [i for i, _ in generate_replies(model, prompts, STOPS, 16, slots=3)]
    assert sorted(order) == list(range(9)) and order != sorted(order, key=lambda i: len(prompts[i]))
    for reply in dict(generate_replies(model, prompts, STOPS, 16, slots=3)).values():
        assert not set(STOPS) & set(reply[:-1]) and (reply[-1] in STOPS or len(reply) == 16)


def test_the_cache_is_allocated_once_and_keeps_keys_in_float64_for_wide_attention():
    model = tiny_base("qwen3-h64-l9")
    prepare_model(model)
    cache = SlotCache(model, slots=5, capacity=70)
    assert len(cache.keys) == model.config.num_hidden_layers
    assert cache.keys[0].shape == (5, 2, 70, 16) and cache.keys[0].dtype == torch.float64


def test_a_slots_bytes_are_what_the_cache_allocates_for_it():
    """What slots_that_fit divides a GPU's free memory by."""
    for prepare in (False, True):  # the model's own dtype, float64 for the wide attention
        model = tiny_base("llama-h48-l7-mqa")
        if prepare:
            prepare_model(model)
        cache = SlotCache(model, slots=3, capacity=40)
        allocated = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
        assert allocated == 3 * SlotCache.slot_bytes(model, 40)
        assert slots_that_fit(model, 40, 7) == 7  # off a GPU: as many as asked


def test_sampled_replies_are_reproducible_from_the_seed():
    model = tiny_base("llama-h48-l7-mqa")
    prepare_model(model)
    prompts = random_prompts(6, 20, seed=2)
    draw = [dict(generate_replies(model, prompts, STOPS, 12, slots=4, temperature=0.8, seed=s)) for s in (5, 5, 6)]
    assert draw[0] == draw[1] and draw[0] != draw[2]


def test_bad_input_is_refused_with_the_reason():
    model = tiny_base("llama-h64-l8-gqa")  # 256 positions
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        list(generate_replies(model, [[1, 2], []], STOPS, 4))
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        list(generate_replies(model, [[1] * 250], STOPS, 8))
    with pytest.raises(ValueError, match="at least 1"):
        list(generate_replies(model, [[1]], STOPS, 0))


def test_real_model_batch_equals_plain_greedy_on_sharegpt_prompts():
    """The embedded SmolLM2 in float32 (the dtype generation uses on CPUs without native bf16)."""
    engine = Engine.over(*load_base(None, dtype="float32"), pack=True)
    model, tokenizer = load_base(None, dtype="float32")
    prepare_model(model)
    firsts = (encode_prompt(tokenizer, m) for m in map(first_prompt, read_conversations()) if m)
    prompts = list(itertools.islice((p for p in firsts if len(p) <= 48), 5))
    assert len({len(p) for p in prompts}) > 1
    replies = dict(generate_replies(model, prompts, stop_ids(tokenizer, model), 16, slots=4))
    assert [replies[i] for i in range(len(prompts))] == [plain_greedy(engine, p, 16) for p in prompts]


@pytest.mark.parametrize("kernels", ["int8", "q4"])
def test_the_engines_grouped_model_generates_its_own_plain_greedy_replies(kernels):
    """The default data command regenerates with the model the engine decodes (the GGUF's groups on int8 or q4
    kernels), its rows batched through transformers' forward: each reply is that engine's plain greedy decoding."""
    model, tokenizer = load_generation_model(None, "cpu", kernels=kernels)
    engine = Engine.load(None, head=None, kernels=kernels)
    assert engine.kernels == kernels and model.config._attn_implementation == engine.model.config._attn_implementation
    firsts = (encode_prompt(tokenizer, m) for m in map(first_prompt, read_conversations()) if m)
    prompts = list(itertools.islice((p for p in firsts if len(p) <= 64), 6))
    replies = dict(generate_replies(model, prompts, stop_ids(tokenizer, model), 24, slots=4))
    assert [replies[i] for i in range(len(prompts))] == [plain_greedy(engine, p, 24) for p in prompts]


def test_fit_takes_its_features_and_targets_from_the_model_the_engine_decodes():
    """For the embedded GGUF, fit's base model is the engine's int8 model: its greedy tokens over a prompt and the
    engine's own plain decoding of it are the same tokens, which are the targets verification accepts."""
    engine = Engine(generation.load_grouped_base(None, "cpu", "float32", "auto"))
    assert engine.kernels == "int8"
    assert generation.load_grouped_base(None, "cpu", "bfloat16", "auto") is None  # grouped kernels take float32
    prompt = encode_prompt(engine.tokenizer, first_prompt(next(iter(read_conversations()))))
    reply = plain_greedy(engine, prompt, 12)
    ids = torch.tensor([prompt + reply])
    _, _, top1 = target_features(Target(engine.model), ids, torch.ones_like(ids, dtype=torch.bool), None)
    assert top1[0, len(prompt) - 1 : -1].tolist() == reply


def test_the_data_command_takes_the_engines_kernels_for_a_gguf_base_and_the_float_path_elsewhere():
    model, _ = load_generation_model(None, "cpu")
    assert model.model.layers[0].mlp.down_proj.int8  # auto = the engine's default for the embedded GGUF
    model, _ = load_generation_model(None, "cpu", gen_dtype="float32", kernels="float")
    assert model.config._attn_implementation == generation.FUSED_WIDE


@pytest.mark.parametrize("architecture", ["qwen2", "gemma3"])
def test_features_through_the_engines_runner_are_the_padded_forwards_bits(tmp_path, architecture):
    """On the fused decoder, training reads each row's features through the engine's own runner; a padded forward of
    the same model gives the very same bits, row by row, so a head learns what the engine will hand it."""
    from engine.testing.tiny_gguf import tiny_gguf
    from engine.train.features import padded_forward

    engine = Engine.load(str(tiny_gguf(architecture, tmp_path, "Q8_0")), head=None, kernels="int8", corpus=None)
    target = Target(engine.model)
    assert target.fused is not None
    layers = [2, 3, 4]
    lengths = [9, 14, 5]
    ids = torch.randint(0, engine.model.config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(4))
    valid = torch.arange(14)[None] < torch.tensor(lengths)[:, None]
    ours = target_features(target, ids, valid, layers)
    theirs = padded_forward(engine.model, ids, valid, layers, True)
    for row, n in enumerate(lengths):
        for mine, other in zip(ours, theirs):
            assert torch.equal(mine[row, :n], other[row, :n])
