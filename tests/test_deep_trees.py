"""Deep drafts through the real decoding loop. Random heads accept at most a couple of drafts a round on the tiny
models; an oracle drafter that proposes the target's own continuation gets whole chains accepted, so tree positions,
masks and the cache compaction are exercised far past depth 2, for greedy decoding and for sampling."""
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import VOCAB, tiny_engine, tokens_of
from engine.decode.loop import decode
from engine.decode.params import DecodeParams
from engine.model.target import Target
from engine.draft.tree import DraftTree, DynamicTree
from engine.decode.accept import Sampling
from oracles import ALPHA, randomized_pit, target_probs, uniformity_pvalue

NEW_TOKENS = 48


class OracleDrafter:
    """The drafter protocol (reset, commit, propose) drafting what `levels(history, n)` says: n pairs (true token,
    distractor). Each level puts the distractor first, so the accepted path skips nodes and the cache compaction
    has to gather, and under the distractor a node holding the next true token: the same token at the same depth
    in another branch, told apart only by the tree mask."""

    def __init__(self, prompt_ids: list[int], levels):
        self.prompt, self.levels = list(prompt_ids), levels
        self.history: list[int] = []

    def reset(self) -> None:
        self.history = self.prompt[:1]

    def commit(self, features: torch.Tensor, next_tokens: torch.Tensor, defer: bool = False) -> None:
        self.history += next_tokens.tolist()  # it runs no head: a deferred slot is as good as a run one

    def propose(self, root: int, tree: DynamicTree) -> DraftTree:
        assert self.history[-1] == root, "the drafter must have been given every committed token"
        tokens, parents, on_path, off_path = [root], [-1], 0, None
        for true, distractor in self.levels(self.history, tree.max_levels):
            tokens.append(distractor), parents.append(on_path)
            if off_path is not None:
                tokens.append(true), parents.append(off_path)
            off_path = len(tokens) - 1 - (off_path is not None)
            tokens.append(true), parents.append(on_path)
            on_path = len(tokens) - 1
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def continuation_of(reference: list[int]):
    """Levels that follow a known greedy output (prompt + tokens), with a distractor that is never the true token."""

    def levels(history: list[int], n: int) -> list[tuple[int, int]]:
        assert history == reference[: len(history)], "greedy decoding left the reference"
        return [(t, (t + 1) % VOCAB) for t in reference[len(history): len(history) + n]]

    return levels


def likeliest_continuation(model):
    """Levels along the target's argmax chain from the history, each with its second likeliest token as the
    distractor, so both drafted siblings hold mass."""

    @torch.inference_mode()
    def levels(history: list[int], n: int) -> list[tuple[int, int]]:
        ids, out = list(history), []
        for _ in range(n):
            first, second = model(torch.tensor([ids])).logits[0, -1].topk(2).indices.tolist()
            out.append((first, second))
            ids.append(first)
        return out

    return levels


@pytest.mark.parametrize("shape", ["llama-h64-l8-gqa", "qwen3-h64-l9"])
@pytest.mark.parametrize("levels", [3, 7])
def test_greedy_accepts_whole_oracle_chains_and_stays_lossless(shape, levels, prompt):
    engine = tiny_engine(shape, None)
    vanilla = tokens_of(decode(engine.target, None, prompt, DecodeParams(method="vanilla", max_new_tokens=NEW_TOKENS)))
    drafter = OracleDrafter(prompt, continuation_of(prompt + vanilla))
    params = DecodeParams(max_new_tokens=NEW_TOKENS, tree=DynamicTree(depth=levels - 1), context=None)  # oracle only
    steps = list(decode(engine.target, drafter, prompt, params))
    assert tokens_of(steps) == vanilla
    rounds = steps[1:-1]  # after the prefill; the last round may be cut at max_new_tokens
    assert [s.accepted for s in rounds] == [levels] * len(rounds), "every drafted level must be accepted"
    assert all(s.tree_size == 3 * levels - 1 for s in rounds)


def _small_peaked_model() -> LlamaForCausalLM:
    """Two layers (cheap to call once per drafted level) with sharp enough logits that chains get accepted."""
    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         initializer_range=0.4, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def test_sampling_through_deep_oracle_trees_draws_the_target_law(prompt):
    """Every sampled token, through trees accepted deep, passes the randomized probability integral transform
    against the target law from one plain forward over the output: the values must be uniform."""
    model, sampling = _small_peaked_model(), Sampling(0.7)
    target, u = Target(model), torch.Generator().manual_seed(0)
    pits, accepted = [], Counter()
    for seed in range(60):
        params = DecodeParams(max_new_tokens=24, sampling=sampling, tree=DynamicTree(depth=3), seed=seed)
        steps = list(decode(target, OracleDrafter(prompt, likeliest_continuation(model)), prompt, params))
        accepted.update(s.accepted for s in steps[1:-1])
        tokens = tokens_of(steps)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
        for token, row in zip(tokens, logits):
            probs = target_probs(row.tolist(), sampling.temperature)
            pits.append(randomized_pit(token, probs, float(torch.rand((), generator=u))))
    assert accepted[4] >= 20 and accepted[3] >= 20, f"too few deep acceptances to test them: {dict(accepted)}"
    assert uniformity_pvalue(pits) > ALPHA
