"""Drafting from the context: chains grafted into the head's tree (or alone, method suffix) keep decoding lossless,
greedy and sampled, and the context index always holds exactly the prompt and the committed tokens."""
import pytest
import torch

from conftest import SHAPES, RecordingDraft, sample_through_copied_drafts, tiny_engine, tokens_of
from engine import DecodeParams, DynamicTree, StaticTree
from engine.draft.context import ChainAcceptance, ContextDraft, ContextIndex
from engine.draft.tree import DraftTree, graft
from engine.decode.accept import Sampling
from oracles import ALPHA, drafted_frequency_pvalue, uniformity_pvalue

NEW_TOKENS = 80


def test_graft_shares_agreeing_nodes_and_marks_new_ones():
    # root 9 -> 1 -> 2, root -> 3
    tree = DraftTree(torch.tensor([9, 1, 3, 2]), torch.tensor([-1, 0, 0, 1]))
    grafted = graft(tree, [[1, 2, 5, 6], [3], [4, 1]])
    assert grafted.tokens.tolist() == [9, 1, 3, 2, 5, 6, 4, 1]
    assert grafted.parents.tolist() == [-1, 0, 0, 1, 3, 4, 0, 6]
    assert grafted.from_context.tolist() == [False] * 4 + [True] * 4
    assert grafted.depths.tolist() == [0, 1, 1, 2, 3, 4, 1, 2]
    bare = graft(DraftTree.bare(7), [[7, 7, 7]])  # a token may repeat down a chain, never among siblings
    assert bare.parents.tolist() == [-1, 0, 1, 2] and bare.from_context.tolist() == [False, True, True, True]


def test_chain_length_grows_with_the_match():
    index = ContextIndex([5, 1, 2, 3, 4, 6, 7, 8, 0, 2, 3, 4, 9, 9, 1, 2, 3])
    # "1 2 3" matched (3 tokens): a chain of 2 * 3 tokens, copied from after the earlier "1 2 3"
    assert ContextDraft(branches=1).chains(index) == [[4, 6, 7, 8, 0, 2]]
    assert ContextDraft(branches=1, tokens_per_match=1.0, max_tokens=4).chains(index) == [[4, 6, 7]]
    assert ContextDraft(branches=1, max_tokens=4).chains(index) == [[4, 6, 7, 8]]
    assert ContextDraft(min_match=4).chains(index) == []
    two = ContextIndex([1, 2, 7, 8, 1, 2, 5, 6, 1, 2])  # "1 2" was followed by 7 and by 5: the latest leads
    assert ContextDraft().chains(two) == [[5, 6, 1, 2], [7, 8]]
    with pytest.raises(ValueError, match="context drafting"):
        ContextDraft(max_tokens=0)


def test_chains_run_up_to_the_last_position_right_more_often_than_a_row_costs():
    acceptance = ChainAcceptance(row_cost=0.3)
    for right in [0, 1, 2, 2, 3, 5, 5, 5]:  # eight chains of five tokens after a 2-token match: k of them right
        chain = [1, 2, 3, 4, 5]
        acceptance.observe(2, chain, chain[:right] + [9])
    assert acceptance.drafted[2] == [8] * 5 and acceptance.right[2] == [7, 6, 4, 3, 3]
    assert acceptance.length(2, 16) == 16  # positions past the fifth not seen yet: the rule's length stays
    assert acceptance.length(2, 3) == 3
    acceptance.observe(2, [1, 2, 3, 4, 5, 6], [1, 2, 9])
    assert acceptance.right[2] == [8, 7, 4, 3, 3, 0]
    # The fourth position is right 3 times in 9: a row dearer than that stops the chain before it...
    assert ChainAcceptance(row_cost=0.34, drafted=acceptance.drafted, right=acceptance.right).length(2, 16) == 3
    assert acceptance.length(2, 16) == 16  # ...a cheaper one does not, and the sixth, seen once, is not known yet
    assert acceptance.length(3, 16) == 16  # another match length: nothing known yet
    for _ in range(8):  # a match of 8 or more tokens is one bucket
        acceptance.observe(12, [4, 4], [5])
    assert acceptance.length(9, 16) == 0 and acceptance.length(7, 16) == 16


def test_chains_sized_by_acceptance_drop_what_does_not_pay_and_leave_the_round_to_the_head():
    index = ContextIndex([5, 1, 2, 3, 4, 6, 7, 8, 0, 2, 3, 4, 9, 9, 1, 2, 3])  # a 3-token match: 6 tokens by the rule
    acceptance = ChainAcceptance(row_cost=0.5)
    for _ in range(8):
        acceptance.observe(3, [4, 6, 7, 1], [4, 6, 2])
    assert ContextDraft(branches=1).chains(index, acceptance=acceptance) == [[4, 6]]
    for _ in range(40):
        acceptance.observe(3, [4], [8])
    assert ContextDraft(branches=1).chains(index, acceptance=acceptance) == []


@pytest.mark.parametrize("method,kind", [("suffix", None), ("eagle", "eagle3")])
def test_an_engine_counts_every_verified_chain_across_generations_and_stays_lossless(method, kind, prompt):
    engine = tiny_engine("llama-h48-l7-mqa", kind)
    engine.chain_acceptance = None  # as an engine starts: made at the first generation that drafts from the context
    vanilla = tokens_of(engine.generate([6] * 24, method="vanilla", max_new_tokens=NEW_TOKENS))
    assert engine.chain_acceptance is None
    first = tokens_of(engine.generate([6] * 24, method=method, max_new_tokens=NEW_TOKENS))
    counted = sum(sum(d) for d in engine.chain_acceptance.drafted.values())
    assert first == vanilla and counted > 0 and engine.chain_acceptance.row_cost >= 0
    mixed = tokens_of(engine.generate(prompt, method=method, max_new_tokens=NEW_TOKENS))
    assert sum(sum(d) for d in engine.chain_acceptance.drafted.values()) > counted
    assert mixed == tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))


def test_the_head_gets_what_the_chains_leave():
    tree = DynamicTree(total_tokens=8)
    assert tree.beside(0) == tree
    assert tree.beside(3) == DynamicTree(total_tokens=5)
    assert tree.beside(6) == DynamicTree(total_tokens=2)
    assert tree.beside(7) is None and tree.beside(16) is None  # a long match's chain has the round to itself
    assert StaticTree().beside(5) == StaticTree()


def test_context_setting_and_suffix_method_checks():
    assert DecodeParams().context == ContextDraft()
    off = DecodeParams().with_options(context=False)
    assert off.context is None and off.with_options(context=True).context == ContextDraft()
    assert DecodeParams().with_options(context=ContextDraft(branches=1)).context.branches == 1
    with pytest.raises(ValueError, match="suffix"):
        DecodeParams(method="suffix", context=None)
    assert DecodeParams(method="suffix").max_levels == ContextDraft().max_tokens
    assert DecodeParams(context=ContextDraft(max_tokens=2)).max_levels == DynamicTree().max_levels
    assert DecodeParams().sizes_chains and not DecodeParams(context=ContextDraft(sized=False)).sizes_chains
    assert not DecodeParams(method="vanilla").sizes_chains and not DecodeParams(context=None).sizes_chains


def _context_tokens(steps) -> int:
    for step in steps:
        assert all(d for d, c in zip(step.drafted, step.from_context) if c), "a context token must be a draft"
    return sum(sum(step.from_context) for step in steps)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind,tree", [("eagle3", "dynamic"), ("eagle1", "static")])
def test_mixed_trees_stay_lossless(shape, kind, tree, prompt):
    engine = tiny_engine(shape, kind)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
    params = DecodeParams().with_options(max_new_tokens=NEW_TOKENS, tree=tree)
    mixed = list(engine.generate(prompt, params))
    head_only = list(engine.generate(prompt, params.with_options(context=False)))
    assert tokens_of(mixed) == tokens_of(head_only) == vanilla
    assert _context_tokens(mixed) > 0 and _context_tokens(head_only) == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_suffix_needs_no_head(shape, prompt):
    engine = tiny_engine(shape, None)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
    steps = list(engine.generate(prompt, method="suffix", max_new_tokens=NEW_TOKENS))
    assert tokens_of(steps) == vanilla
    assert _context_tokens(steps) > 0
    with pytest.raises(ValueError, match="needs a draft head"):
        engine.generate(prompt, method="eagle")


# Prompts these random models answer by repeating one token: the whole answer matches the prompt.
REPEATERS = [("qwen2-h32-l10-tied", [9] * 24)]


@pytest.mark.parametrize("shape,repeated", REPEATERS)
@pytest.mark.parametrize("method,kind", [("suffix", None), ("eagle", "eagle1"), ("eagle", "eagle3")])
def test_a_model_that_repeats_gets_whole_chains_past_the_heads_depth(shape, repeated, method, kind):
    engine = tiny_engine(shape, kind)
    vanilla = tokens_of(engine.generate(repeated, method="vanilla", max_new_tokens=NEW_TOKENS))
    steps = list(engine.generate(repeated, method=method, max_new_tokens=NEW_TOKENS))
    assert tokens_of(steps) == vanilla
    longest = ContextDraft().max_tokens
    assert max(sum(s.from_context) for s in steps) == longest > DynamicTree().max_levels
    assert len(steps) <= 2 + NEW_TOKENS // longest, "every round should accept the whole chain"


@pytest.mark.parametrize("method", ["eagle", "suffix"])
@pytest.mark.parametrize("plain_every", [0, 3])
def test_the_index_holds_the_prompt_and_every_committed_token(method, plain_every, prompt):
    engine = tiny_engine("qwen2-h32-l10-tied", "eagle3")
    draft = RecordingDraft()
    params = DecodeParams(method=method, max_new_tokens=40, context=draft, plain_every=plain_every)
    steps = list(engine.generate(prompt, params))
    speculative = [i for i, s in enumerate(steps) if s.kind == "speculative"]
    assert len(draft.seen) == len(speculative) > 0
    for (text, _), i in zip(draft.seen, speculative):
        assert text == prompt + tokens_of(steps[:i])


@pytest.mark.parametrize("method", ["eagle", "suffix"])
def test_sampling_through_context_chains_draws_the_target_law(method):
    """Every sampled token passes the randomized probability integral transform against the target law from one
    plain forward over the output, with many of them accepted from context chains (q = 1 for those, too)."""
    engine = tiny_engine("llama-h48-l7-mqa", "eagle3")
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]
    chains = ContextDraft(min_match=1)  # sampled text rarely repeats 2 tokens: draft from every match, to test many
    sample = sample_through_copied_drafts(engine, prompt, lambda seed: DecodeParams(
        method=method, max_new_tokens=24, sampling=Sampling(0.6), seed=seed, context=chains))
    assert sample.copied >= 60, f"only {sample.copied} sampled tokens came from context chains"
    assert drafted_frequency_pvalue(sample.drafts) > ALPHA
    assert uniformity_pvalue(sample.pits) > ALPHA


@pytest.fixture(scope="module")
def real_engine():
    from engine import Engine

    return Engine.load(dtype="float32")


@pytest.mark.parametrize("text", [  # prompts the embedded model answers by quoting them
    "Rewrite this Python function with type hints:\n\ndef add_numbers(first_number, second_number):\n"
    "    total = first_number + second_number\n    return total",
    "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape.",
])
def test_real_model_greedy_equals_vanilla_with_context_chains(real_engine, text):
    ids = real_engine.encode_chat([{"role": "user", "content": text}])
    vanilla = tokens_of(real_engine.generate(ids, method="vanilla", max_new_tokens=48))
    for method in ("eagle", "suffix"):
        steps = list(real_engine.generate(ids, method=method, max_new_tokens=48))
        assert tokens_of(steps) == vanilla, method
        assert _context_tokens(steps) >= 10, (method, [s.from_context for s in steps])


def test_bench_no_suffix_turns_context_off_and_refuses_method_suffix(tmp_path):
    from engine.tools.bench import build_parser, check_args

    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["Hi"]}\n')
    parse = build_parser().parse_args
    assert check_args(parse(["--questions", str(questions), "--methods", "eagle,suffix"])).params.context
    assert check_args(parse(["--questions", str(questions), "--methods", "eagle",
                             "--no-suffix"])).params.context is None
    with pytest.raises(ValueError, match="no-suffix"):
        check_args(parse(["--questions", str(questions), "--methods", "eagle,suffix", "--no-suffix"]))
    assert check_args(parse(["--questions", str(questions)])).params.context.sized
    assert not check_args(parse(["--questions", str(questions), "--fixed-chains"])).params.context.sized


def test_real_model_greedy_equals_vanilla_drafting_from_its_own_replies(real_engine):
    """The embedded model's corpus (data/selfdistill): drafts where the context has none, and the same tokens."""
    assert real_engine.corpus is not None and len(real_engine.corpus) > 4_000_000
    ids = real_engine.encode_chat([{"role": "user", "content": "Give me three tips for a good night's sleep."}])
    vanilla = tokens_of(real_engine.generate(ids, method="vanilla", max_new_tokens=64))
    for method in ("eagle", "suffix"):
        steps = list(real_engine.generate(ids, method=method, max_new_tokens=64))
        alone = list(real_engine.generate(ids, method=method, max_new_tokens=64, corpus=False))
        assert tokens_of(steps) == tokens_of(alone) == vanilla, method
        assert _context_tokens(steps) >= _context_tokens(alone) + 3, method
