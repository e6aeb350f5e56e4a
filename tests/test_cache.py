"""After every round the compacted base KV cache must equal what a plain forward over the accepted text builds, and
neither a forward nor the compaction may copy the whole cache."""
import pytest
import torch

from conftest import SHAPES, IdsOnlyTokenizer, tiny_base, tiny_engine
from engine import Engine
from engine.model import kernels
from engine.model import cache as kv_cache
from engine.model.cache import GrowingLayer, keep_path, truncate
from engine.model.target import Target


@pytest.mark.parametrize("spare", [kv_cache.MIN_SPARE, 2])  # 2: the buffers grow every few rounds
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_compacted_cache_matches_fresh_forward(kind, spare, prompt, monkeypatch):
    monkeypatch.setattr(kv_cache, "MIN_SPARE", spare)
    engine = tiny_engine("llama-h64-l8-gqa", kind)
    caches = []
    original = Target.new_cache
    monkeypatch.setattr(Target, "new_cache", lambda self: caches.append(original(self)) or caches[-1])
    produced = []
    rounds_checked = 0
    for step in engine.generate(prompt, method="eagle", max_new_tokens=50):
        produced += step.tokens
        if step.finish_reason:
            break
        # The newest token (the next root) is not in the cache yet: everything before it is.
        committed = prompt + produced[:-1]
        fresh = engine.model(torch.tensor([committed]), use_cache=True).past_key_values
        cache = caches[0]
        assert cache.get_seq_length() == len(committed)
        for ours, ref in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(ours.keys, ref.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ours.values, ref.values, rtol=1e-4, atol=1e-4)
        rounds_checked += step.accepted > 0
    assert rounds_checked > 0, "no round accepted a draft, so no compaction was exercised"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_rounds_write_into_the_cache_in_place(shape, prompt, monkeypatch):
    """DynamicCache re-allocates every layer's keys on every forward; this cache only when it runs out of room."""
    engine = tiny_engine(shape, "eagle3")
    caches = []
    original = Target.new_cache
    monkeypatch.setattr(Target, "new_cache", lambda self: caches.append(original(self)) or caches[-1])
    storages = set()
    rounds = 0
    for step in engine.generate(prompt, method="eagle", max_new_tokens=40):
        storages.add(caches[0].layers[0].keys.data_ptr())
        rounds += 1
    assert rounds > 10 and len(storages) == 1


def random_states(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, length, 8, generator=generator) for _ in range(2))


def test_growing_layer_holds_what_concatenation_holds(monkeypatch):
    monkeypatch.setattr(kv_cache, "MIN_SPARE", 3)
    layer, keys, values = GrowingLayer(), None, None
    capacities = set()
    for seed, length in enumerate([5, 1, 1, 9, 2, 30, 1]):
        new_keys, new_values = random_states(length, seed)
        returned = layer.update(new_keys, new_values)
        keys = new_keys if keys is None else torch.cat([keys, new_keys], dim=-2)
        values = new_values if values is None else torch.cat([values, new_values], dim=-2)
        for ours, ref in zip((*returned, layer.keys, layer.values), (keys, values) * 2):
            assert torch.equal(ours, ref)
        assert layer.get_seq_length() == keys.shape[-2]
        capacities.add(layer.capacity)
    assert len(capacities) > 2, "the buffers never grew: the test would not exercise growth"


def test_keep_path_keeps_the_prefix_and_the_path_in_order():
    layer = GrowingLayer()
    keys, values = random_states(16, 0)  # a 10-token prefix and a 6-node tree
    layer.update(keys, values)
    cache = kv_cache.GrowingCache()
    cache.layers.append(layer)
    keep_path(cache, 10, [0, 2, 5])
    rows = [*range(10), 10, 12, 15]
    assert torch.equal(layer.keys, keys[..., rows, :]) and torch.equal(layer.values, values[..., rows, :])
    more_keys, more_values = random_states(4, 1)
    layer.update(more_keys, more_values)
    assert torch.equal(layer.keys, torch.cat([keys[..., rows, :], more_keys], dim=-2))
    truncate(cache, 11)
    assert torch.equal(layer.values, values[..., rows[:11], :])


@pytest.mark.parametrize("path", [[0], [0, 1, 2], [0, 1, 3]])
def test_a_path_already_in_place_or_not_leaves_the_same_cache(path):
    keys, values = random_states(16, 0)
    layer = GrowingLayer()
    layer.update(keys, values)
    cache = kv_cache.GrowingCache()
    cache.layers.append(layer)
    keep_path(cache, 10, path)
    rows = [*range(10), *(10 + node for node in path)]
    assert layer.length == len(rows)
    assert torch.equal(layer.keys, keys[..., rows, :]) and torch.equal(layer.values, values[..., rows, :])


def test_compacting_another_cache_is_refused():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(*random_states(4, 0), layer_idx=0)
    with pytest.raises(TypeError, match="needs a GrowingCache"):
        keep_path(cache, 2, [0])


@pytest.mark.parametrize("kernel_choice,pack,cached", [
    ("int8", True, torch.float16), ("q4", True, torch.float16), ("float", True, torch.float32),
    ("float", False, torch.float32)])
def test_the_grouped_kernels_keep_a_float16_cache(kernel_choice, pack, cached, prompt):
    """On the grouped kernels the cache holds float16 (half the bytes a long context's steps read): the first
    layer's keys are the model's float32 keys rounded once; float layers keep the model's dtype, as transformers."""
    if pack and not kernels.available():
        pytest.skip("engine/model/kernels unavailable: no fixed-order attention")
    engine = Engine.over(tiny_base("llama-h64-l8-gqa"), IdsOnlyTokenizer(), pack=pack, kernels=kernel_choice)
    cache = engine.target.new_cache()
    engine.target.forward(torch.tensor(prompt), cache)
    assert {layer.keys.dtype for layer in cache.layers} == {layer.values.dtype for layer in cache.layers} == {cached}
    own = kv_cache.GrowingCache()  # the model's own dtype
    engine.target.forward(torch.tensor(prompt), own)
    assert own.layers[0].keys.dtype == torch.float32
    assert torch.equal(cache.layers[0].keys, own.layers[0].keys.to(cached))
    assert torch.equal(cache.layers[0].values, own.layers[0].values.to(cached))
