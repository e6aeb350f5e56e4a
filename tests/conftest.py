"""Shared fixtures: tiny random-weight base models of several shapes and families, with random draft heads."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from engine import Engine
from engine.draft.context import ContextDraft, ContextIndex
from engine.draft.checkpoint import new_head, place_head
from engine.draft.drafter import Drafter
from engine.decode.gate import HeadGate
from engine.model.packed import packable_dtypes
from oracles import randomized_pit, target_probs

# Tiny models gain nothing from threads, and extra threads thrash when several test processes share the CPU.
torch.set_num_threads(1)

# Dtypes whose packed CPU forward is batch-invariant here: bfloat16 only on CPUs that oneDNN packs it for.
PACKED_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    torch.bfloat16 not in packable_dtypes(), reason="oneDNN packs bfloat16 only on CPUs with AVX-512 BF16 or AMX"))]

# A small vocabulary makes random drafts hit often, so multi-token paths are exercised.
VOCAB = 16
SHAPES = {
    "llama-h64-l8-gqa": (LlamaConfig, LlamaForCausalLM,
                         dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)),
    "llama-h48-l7-mqa": (LlamaConfig, LlamaForCausalLM,
                         dict(hidden_size=48, num_hidden_layers=7, num_attention_heads=3, num_key_value_heads=1)),
    "qwen2-h32-l10-tied": (Qwen2Config, Qwen2ForCausalLM,
                           dict(hidden_size=32, num_hidden_layers=10, num_attention_heads=2, num_key_value_heads=2,
                                tie_word_embeddings=True)),
    "qwen3-h64-l9": (Qwen3Config, Qwen3ForCausalLM,
                     dict(hidden_size=64, num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16)),
}


class IdsOnlyTokenizer:
    """These tests feed token ids directly; only the stop-token lookup needs a tokenizer."""

    eos_token_id = None


def tiny_base(shape: str, vocab: int = VOCAB, seed: int = 0, dtype: torch.dtype = torch.float32):
    config_cls, model_cls, sizes = SHAPES[shape]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab, intermediate_size=96, initializer_range=0.25, max_position_embeddings=256, eos_token_id=None,
        bos_token_id=None, pad_token_id=None, **sizes,
    )
    model = model_cls(config).to(dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model


def random_head(model, kind: str, seed: int = 1):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    head = new_head(kind, model.config, draft_vocab_size=vocab - 4 if kind == "eagle3" else None)
    if kind == "eagle3":
        head.set_vocab(torch.randperm(vocab)[: vocab - 4])
    for p in head.parameters():  # larger weights than the default init: sharper, more varied drafts
        torch.nn.init.normal_(p, std=0.3)
    return place_head(head, model)


def tiny_engine(
    shape: str, kind: str | None, vocab: int = VOCAB, pack: bool = False, dtype: torch.dtype = torch.float32
) -> Engine:
    model = tiny_base(shape, vocab, dtype=dtype)
    return Engine(model, IdsOnlyTokenizer(), random_head(model, kind) if kind else None, pack=pack)


# A dynamic tree that branches and reaches three levels: lossless tests need tree rows that see different
# ancestors (the default tree drafts a single token, the fastest on the development CPU).
BRANCHING = dict(total_tokens=8, depth=2, draft_top_k=4)


class Alternating(HeadGate):
    """The head gate's windows, but its arms in turn whatever their speeds (as an engine's gate): every kind of
    switch happens, slots deferred and caught up."""

    def _next_arm(self) -> bool:
        return not self.head


def assert_drafter_holds(engine: Engine, drafter: Drafter, text: list[int]) -> None:
    """The drafter's cache is what committing the text's true features from scratch builds: its slot p pairs the
    base features after text[p] with text[p + 1]."""
    _, features = engine.target.forward(torch.tensor(text[:-1]), engine.target.new_cache())
    fresh = Drafter(engine.head)
    fresh.commit(features, torch.tensor(text[1:]))
    assert drafter.length == fresh.length == len(text) - 1
    for layer, fresh_layer in zip(drafter.cache, fresh.cache, strict=True):
        torch.testing.assert_close(layer.keys, fresh_layer.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.values, fresh_layer.values, rtol=1e-4, atol=1e-4)


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


@pytest.fixture
def prompt() -> list[int]:
    return torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()


@dataclass(frozen=True)
class RecordingDraft(ContextDraft):
    """ContextDraft that keeps, at every round, the index's text and the chains it drafted."""

    seen: list = field(default_factory=list, compare=False)

    @classmethod
    def like(cls, draft: ContextDraft) -> RecordingDraft:
        return cls(**{f.name: getattr(draft, f.name) for f in fields(ContextDraft)})

    def chains(self, index: ContextIndex, corpus=None) -> list[list[int]]:
        chains = super().chains(index, corpus)
        self.seen.append((list(index.tokens), chains))
        return chains


@dataclass
class CopiedDraftSample:
    pits: list[float]  # randomized PIT of every sampled token against the target law
    drafts: list[tuple[bool, float]]  # per chain's first token: drawn or not, its target probability
    copied: int  # tokens accepted from chains copied without the head (the context's or the corpus's)


def sample_through_copied_drafts(engine: Engine, prompt: list[int], params_of_seed,
                                 seeds=range(40)) -> CopiedDraftSample:
    """Sample an answer per seed (params_of_seed(seed): DecodeParams with a context draft) and judge every token
    against the target law of one plain forward over the answer (oracles: randomized_pit, drafted_frequency)."""
    u = torch.Generator().manual_seed(0)
    sample = CopiedDraftSample([], [], 0)
    for seed in seeds:
        params = params_of_seed(seed)
        recorder = RecordingDraft.like(params.context)
        steps = list(engine.generate(prompt, replace(params, context=recorder)))
        sample.copied += sum(sum(s.from_context) for s in steps)
        text = prompt + tokens_of(steps)
        with torch.inference_mode():
            logits = engine.model(torch.tensor([text])).logits[0]
        # the law of text[i] at law[i - 1], for the answer's tokens only
        law = {i: target_probs(logits[i].tolist(), params.sampling.temperature)
               for i in range(len(prompt) - 1, len(text) - 1)}
        for i in range(len(prompt), len(text)):
            sample.pits.append(randomized_pit(text[i], law[i - 1], float(torch.rand((), generator=u))))
        for seen, chains in recorder.seen:
            at = len(seen)  # the chains' first tokens are drafts for text[at]
            sample.drafts += [(text[at] == chain[0], law[at - 1][chain[0]]) for chain in chains]
    return sample
