"""The head gate: which arm gets the rounds (from measured speeds), and that switching arms keeps the output and the
drafter's state right (slots deferred while the head rests, caught up when it drafts again)."""
import pytest

from conftest import BRANCHING, Alternating, assert_drafter_holds, tiny_engine, tokens_of
from engine import DecodeParams
from engine.draft.drafter import Drafter
from engine.decode.gate import EXPLORING_COST, MAX_PERIOD, HeadGate
from engine.decode.loop import decode
from engine.decode.prefixes import PrefixStore

NEW_TOKENS = 80


def arms_of(gate: HeadGate, speeds: dict[bool, float], windows: int) -> list[bool]:
    """The arm of each window when every round of an arm takes 1 / speeds[arm] seconds for one token."""
    arms = []
    for _ in range(windows):
        arms.append(gate.head)
        for _ in range(gate.window):
            gate.observe(1, 1 / speeds[gate.head])
    return arms


def test_the_head_drafts_first_then_each_arm_is_measured_once():
    assert arms_of(HeadGate(window=4), {True: 100.0, False: 200.0}, 2) == [True, False]


@pytest.mark.parametrize("head_speed, other_speed", [(300.0, 200.0), (200.0, 230.0), (500.0, 100.0), (100.0, 104.0)])
def test_the_faster_arm_gets_the_windows_and_exploring_costs_little(head_speed, other_speed):
    speeds = {True: head_speed, False: other_speed}
    arms = arms_of(HeadGate(), speeds, 200)[2:]
    faster = head_speed > other_speed
    share_slower = sum(arm != faster for arm in arms) / len(arms)
    gap = max(speeds.values()) / min(speeds.values()) - 1
    assert share_slower > 0, "the slower arm is never tried again: a change of text or load would go unseen"
    assert share_slower <= max(1 / MAX_PERIOD, EXPLORING_COST / gap) + 0.01
    assert share_slower * gap <= EXPLORING_COST + 0.01 or share_slower <= 0.5


def test_a_held_up_window_does_not_turn_the_gate():
    gate = HeadGate(window=4)
    arms_of(gate, {True: 300.0, False: 200.0}, 40)
    held_up = gate.head
    for _ in range(gate.window):  # one window held up tenfold (say, a browser repaint)
        gate.observe(1, 10 / (300.0 if held_up else 200.0))
    arms_of(gate, {True: 300.0, False: 200.0}, 1)
    assert gate.head_ratio == pytest.approx(1.5)


def test_arms_are_compared_where_they_are_adjacent_not_across_a_change_of_text():
    """The text's own speed swings far more than the arms differ: a slow passage must not count against whichever
    arm happened to run it. Here every speed halves after 60 windows; the head's arm stays 20 % faster throughout."""
    gate = HeadGate(window=4)
    early = arms_of(gate, {True: 360.0, False: 300.0}, 60)
    later = arms_of(gate, {True: 180.0, False: 150.0}, 60)
    assert gate.head_ratio == pytest.approx(1.2)
    assert sum(early[10:]) >= 40 and sum(later) >= 50


def test_the_gate_follows_a_change_of_speed():
    gate = HeadGate(window=4)
    arms_of(gate, {True: 300.0, False: 200.0}, 20)
    later = arms_of(gate, {True: 100.0, False: 200.0}, 200)
    assert sum(later[-50:]) <= 5, "the head kept drafting after it became the slower arm"


def test_a_window_of_no_rounds_is_refused():
    with pytest.raises(ValueError, match="at least 1 round"):
        HeadGate(window=0)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("switching", ["measured", "alternating"])
def test_gated_greedy_equals_vanilla(kind, switching, prompt):
    engine = tiny_engine("llama-h64-l8-gqa", kind)
    if switching == "alternating":
        engine.gate = Alternating(window=3)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=NEW_TOKENS))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=NEW_TOKENS, gate=True, context=False,
                                  **BRANCHING))
    assert tokens_of(steps) == vanilla
    rounds = [s for s in steps if s.kind == "speculative"]
    assert any(s.with_head for s in rounds) and not all(s.with_head for s in rounds), "one arm never ran"
    assert all(s.with_head == (s.tree_size > 0) for s in rounds)  # no context: the head drafts or nothing does
    assert sum(s.accepted for s in steps) > 0


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_deferred_slots_are_caught_up_to_the_accepted_texts_features(kind, prompt):
    """While the head rests its slots wait; when it drafts again its cache holds what committing the accepted
    text's true features from scratch builds (tests/test_drafter.py's check, across the switches)."""
    engine = tiny_engine("llama-h64-l8-gqa", kind)
    drafter = Drafter(engine.head)
    text, waited, caught_up = list(prompt), 0, 0
    params = DecodeParams(max_new_tokens=60, gate=True, plain_every=5, plain_run=2).with_options(**BRANCHING)
    for step in decode(engine.target, drafter, prompt, params, gate=Alternating(window=3)):
        if step.finish_reason:
            break
        text += step.tokens
        assert drafter.length + drafter.deferred == len(text) - 1
        waited += drafter.deferred > len(step.tokens)  # earlier steps' slots wait too
        if step.with_head:  # its proposal ran every slot before it; its own wait for the next one
            assert drafter.deferred == len(step.tokens)
            caught_up += 1
            drafter.catch_up()
            assert_drafter_holds(engine, drafter, text)
    assert waited > 3 and caught_up > 3, (waited, caught_up)


def test_a_kept_prefix_has_the_heads_slots_caught_up(prompt):
    """An answer that ends while the head rests still leaves the next turn a head cache as long as the base's."""
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    engine.prefixes, engine.gate = PrefixStore(), Alternating(window=3)
    for new_tokens in range(20, 27):  # windows of 3 rounds, carried over: some answers end in a resting window
        steps = list(engine.generate(prompt, method="eagle", max_new_tokens=new_tokens, gate=True))
        kept = engine.prefixes.entries[-1]
        # an answer cut at its limit inside an accepted path leaves the path's further positions in both caches
        assert kept.head_length == kept.cache.get_seq_length() >= len(prompt) + len(tokens_of(steps)) - 1


def test_the_engines_gate_carries_what_it_measured_from_answer_to_answer(prompt):
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    list(engine.generate(prompt, method="eagle", max_new_tokens=60, gate=True))
    measured = list(engine.gate.ratios)
    assert measured
    list(engine.generate(prompt, method="eagle", max_new_tokens=60))  # no gate asked for: it measures nothing
    assert engine.gate.ratios == measured


def test_a_seeded_sampler_keeps_the_head_drafting_so_the_seed_repeats_the_answer(prompt):
    """The gate's choices follow the machine's timing and a seeded sampler's draws follow the drafts: with a seed
    the gate stays off, and so do the context's chains sized by what earlier answers verified, and the same seed
    gives the same answer whatever the gate would have done."""
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    engine.chain_acceptance = None
    options = dict(method="eagle", max_new_tokens=40, temperature=0.9, seed=5, **BRANCHING)
    ungated = tokens_of(engine.generate(prompt, **options))
    for window in (1, 2, 3):
        engine.gate = Alternating(window=window)
        assert tokens_of(engine.generate(prompt, gate=True, **options)) == ungated
    assert DecodeParams(gate=True).gated and DecodeParams(gate=True, seed=5).with_options(temperature=0).gated
    assert not DecodeParams(gate=True, seed=5).with_options(temperature=0.9).gated
    assert not DecodeParams(gate=True, method="suffix").gated
    assert engine.chain_acceptance is None


def test_rounds_say_whether_the_head_took_part(prompt):
    engine = tiny_engine("llama-h64-l8-gqa", "eagle3")
    for method, gate, head in (("eagle", False, True), ("suffix", False, False), ("vanilla", True, False)):
        steps = list(engine.generate(prompt, method=method, max_new_tokens=30, gate=gate))
        assert all(s.with_head == head for s in steps if s.kind == "speculative")
        assert not any(s.with_head for s in steps if s.kind != "speculative")
