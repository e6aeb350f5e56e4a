"""After every round the compacted base KV cache must equal what a plain forward over the accepted text builds."""
import pytest
import torch

from conftest import tiny_engine
from engine.target import Target


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_compacted_cache_matches_fresh_forward(kind, prompt, monkeypatch):
    engine = tiny_engine("llama-h64-l8-gqa", kind)
    caches = []
    original = Target.new_cache
    monkeypatch.setattr(Target, "new_cache", lambda self: caches.append(original(self)) or caches[-1])
    produced = []
    rounds_checked = 0
    for step in engine.generate(prompt, "eagle", max_new_tokens=50):
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
