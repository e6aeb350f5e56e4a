"""End to end on the embedded SmolLM2-135M-Instruct with the shipped EAGLE-3 head (and the EAGLE-1 comparison head),
on the default engine (the GGUF's own groups on the int8 kernels where they build), on the float path in float32,
and in bfloat16 on CPUs that multiply it natively; more on the grouped kernels: tests/test_quant.py."""
import json
from pathlib import Path

import pytest
import torch

from conftest import BRANCHING, tokens_of
from engine import Engine
from engine.model import kernels
from engine.draft.checkpoint import DEFAULT_HEAD
from engine.draft.fused import FusedEagle3
from engine.model.load import load_base
from engine.model.packed import PackedLinear, bf16_native, packing_available

BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench" / "mt_bench.jsonl"
FALLBACK_PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "List three uses of copper."]


def _prompts(n: int) -> list[str]:
    if BENCH.exists():
        return [json.loads(line)["turns"][0] for line in BENCH.read_text().splitlines()[:n]]
    return FALLBACK_PROMPTS[:n]


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine():
    return Engine.load()


@pytest.fixture(scope="module")
def engine_fp32(engine):
    float32 = engine.model.dtype == torch.float32 and engine.kernels == "float"
    return engine if float32 else Engine.load(dtype="float32", kernels="float")


def test_default_engine_has_the_shipped_eagle3_head(engine):
    assert DEFAULT_HEAD.exists()
    assert engine.head is not None and engine.head.kind == "eagle3"
    if packing_available():  # the CPU fast path is what the default engine decodes with, so the tests cover it
        assert engine.batch_invariant
        if kernels.available():  # the GGUF's own groups, one kernel call a forward; the head drafts on Q8_0 ones
            assert engine.kernels == "int8" and engine.quantized_layers > 0 and engine.target.fused is not None
            assert engine.head.fc.weight.dtype == torch.float32 and FusedEagle3.of(engine.head) is not None
        else:
            assert engine.kernels == "float" and engine.packed_layers > 0


def test_the_engine_says_what_runs(engine, engine_fp32):
    """The log at load and the app's header name the base, its tensor types, the head and the kernel path."""
    base, head, runs = engine.description().lines()
    assert "smollm2" in base and "(llama; " in base and "Q4_1" in base
    assert str(DEFAULT_HEAD) in head and "eagle3" in head
    assert ("fast exact path" in runs) == (engine.target.fused is not None)
    if engine_fp32.target.fused is None:
        assert "through transformers' layers (" in engine_fp32.description().lines()[2]


def test_vanilla_equals_transformers_generate(engine_fp32):
    """Against the model as transformers runs it, in float32: packed layers and wide attention change no token."""
    engine = engine_fp32
    ids = engine.encode_chat([{"role": "user", "content": _prompts(1)[0]}])
    ours = tokens_of(engine.generate(ids, method="vanilla", max_new_tokens=24))
    stock, _ = load_base(None)
    assert not any(isinstance(m, PackedLinear) for m in stock.modules())
    ref = stock.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=list(engine.stop_ids))
    assert ours == ref[0, len(ids):].tolist()


def test_eagle_greedy_equals_vanilla_with_real_acceptance(engine):
    """On the default engine, a branching tree."""
    forwards = produced = 0
    for text in _prompts(3):
        ids = engine.encode_chat([{"role": "user", "content": text}])
        vanilla = tokens_of(engine.generate(ids, method="vanilla", max_new_tokens=48))
        steps = list(engine.generate(ids, method="eagle", max_new_tokens=48, **BRANCHING))
        assert tokens_of(steps) == vanilla
        forwards += len(steps) - 1
        produced += len(vanilla) - 1
    tau = produced / forwards
    assert tau > 1.5, f"τ {tau:.2f}: the shipped head should accept drafts (a branching tree)"


def test_a_chat_turn_reuses_the_last_turns_cache_and_answers_as_a_fresh_prefill(engine):
    """The next turn's prompt re-encodes the answer the last turn produced: most of it matches the kept cache's
    tokens, and decoding from that cache gives the answer a full prefill gives."""
    chat = [{"role": "user", "content": "Name three rivers in Europe."}]
    answer = engine.chat_text(chat, max_new_tokens=40)
    chat += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Which of them is the longest?"}]
    ids = engine.encode_chat(chat)
    assert engine.prefixes.entries[-1].usable(ids, with_head=True) > len(ids) * 3 // 4
    reused = tokens_of(engine.generate(ids, max_new_tokens=40))
    engine.prefixes.entries.clear()  # nothing kept: a full prefill
    assert reused == tokens_of(engine.generate(ids, max_new_tokens=40))


def test_eagle_greedy_equals_vanilla_in_float32(engine_fp32):
    for text in _prompts(2):
        ids = engine_fp32.encode_chat([{"role": "user", "content": text}])
        vanilla = tokens_of(engine_fp32.generate(ids, method="vanilla", max_new_tokens=48))
        assert tokens_of(engine_fp32.generate(ids, method="eagle", max_new_tokens=48)) == vanilla


@pytest.mark.skipif(not bf16_native(), reason="the float path runs bfloat16 only where the CPU multiplies it natively")
def test_eagle_greedy_equals_vanilla_in_bfloat16():
    engine = Engine.load(dtype="bfloat16", kernels="float")
    assert engine.model.dtype == engine.head.fc.weight.dtype == torch.bfloat16 and engine.packed_layers > 0
    for text in _prompts(2):
        ids = engine.encode_chat([{"role": "user", "content": text}])
        vanilla = tokens_of(engine.generate(ids, method="vanilla", max_new_tokens=48))
        steps = list(engine.generate(ids, method="eagle", max_new_tokens=48, **BRANCHING))
        assert tokens_of(steps) == vanilla
        assert sum(s.accepted for s in steps) > 0, "the head accepted no draft in bfloat16"


def test_shipped_eagle1_head_is_lossless_with_real_acceptance(engine):
    eagle1 = engine.with_head(DEFAULT_HEAD.parent / "smollm2-135m-eagle1")
    assert eagle1.head.kind == "eagle1" and eagle1.model is engine.model
    ids = engine.encode_chat([{"role": "user", "content": _prompts(1)[0]}])
    vanilla = tokens_of(engine.generate(ids, method="vanilla", max_new_tokens=48))
    steps = list(eagle1.generate(ids, method="eagle", max_new_tokens=48))
    assert tokens_of(steps) == vanilla
    assert sum(s.accepted for s in steps) > 0, "the EAGLE-1 head accepted no draft"


def test_static_tree_is_lossless_too(engine):
    ids = engine.encode_chat([{"role": "user", "content": _prompts(2)[1]}])
    vanilla = tokens_of(engine.generate(ids, method="vanilla", max_new_tokens=32))
    assert tokens_of(engine.generate(ids, method="eagle", max_new_tokens=32, tree="static")) == vanilla


def test_multi_turn_chat_text(engine):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    reply = engine.chat_text(messages, max_new_tokens=24)
    assert "Rome" in reply
    assert "<|im_end|>" not in reply
