"""The speedup meter: figures from Steps, a baseline timed inside the same answer, and the panel's HTML."""
from __future__ import annotations

import re

import pytest

from app.meter import PLAIN_EVERY, PLAIN_RUN, SETTLING, TurnMeter, meter_html, status_html, turn_log_line
from engine import DecodeParams, Step


def step(n_drafted: int, seconds: float, finish: str | None = None, kind: str = "speculative",
         draft_s: float = 0.0) -> Step:
    return Step(list(range(n_drafted + 1)), [True] * n_drafted + [False], wall_s=seconds, draft_s=draft_s,
                finish_reason=finish, kind=kind)


def test_turn_figures_leave_out_the_prefill():
    turn = TurnMeter("eagle")
    turn.add(step(0, 5.0, kind="prefill"))  # a slow prefill must not lower the decoding speed
    for drafted in (3, 0, 2):
        turn.add(step(drafted, 0.5))
    assert (turn.rounds, turn.tokens, turn.prefill_s) == (3, 8, 5.0)
    assert turn.tokens_per_s == pytest.approx(8 / 1.5)
    assert turn.tau == pytest.approx(8 / 3)
    assert turn.per_round == [4, 1, 3]


def plain_run(turn: TurnMeter, timed: list[float], settling_s: float = 0.9, draft_s: float = 0.0) -> None:
    """A run of plain steps as the app schedules them: SETTLING steps (slow: right after drafting), then `timed`."""
    for _ in range(SETTLING):
        turn.add(step(0, settling_s, kind="plain"))
    for seconds in timed:
        turn.add(step(0, seconds, kind="plain", draft_s=draft_s))


def test_speedup_divides_by_plain_steps_timed_in_the_same_answer():
    turn = TurnMeter("eagle")
    turn.add(step(0, 1.0, kind="prefill"))
    turn.add(step(3, 0.5))
    assert turn.speedup is None and "once a plain decoding step" in turn.basis()  # nothing timed, nothing claimed
    for _ in range(SETTLING):
        turn.add(step(0, 0.9, kind="plain"))
    assert turn.speedup is None  # a step right after drafting is slower than plain decoding: not its measure
    turn.add(step(0, 0.30, kind="plain", draft_s=0.05))  # its drafter upkeep is not plain decoding's cost
    turn.add(step(1, 0.25))
    plain_run(turn, [0.20])
    answer_rate, plain_rate = (8 + 2 * SETTLING) / (1.25 + 2 * SETTLING * 0.9), 2 / (0.25 + 0.20)
    assert turn.tokens_per_s == pytest.approx(answer_rate)  # what the user got, every plain step included
    assert turn.plain.steps == 2 and turn.speedup == pytest.approx(answer_rate / plain_rate)
    assert turn.tau == pytest.approx(6 / 2)  # drafting rounds only, as the benchmark's tau
    assert f"a run of {PLAIN_RUN} every {PLAIN_EVERY} rounds" in turn.basis() and "2 plain steps" in turn.basis()


def test_the_app_schedules_runs_long_enough_to_time():
    params = DecodeParams(plain_every=PLAIN_EVERY, plain_run=PLAIN_RUN)
    first = PLAIN_EVERY // 2  # past the answer's first rounds, which the page's first update slows
    assert SETTLING < PLAIN_RUN and [params.plain_round(i) for i in range(first + PLAIN_RUN + 1)] == [
        *[False] * first, *[True] * PLAIN_RUN, False]


def test_the_speedup_carries_the_standard_error_of_its_plain_sample():
    """The baseline is a few steps of a noisy machine: the meter says how far off it may be, once it can tell."""
    turn = TurnMeter("eagle")
    turn.add(step(0, 1.0, kind="prefill"))
    for seconds in (0.1, 0.2):
        turn.add(step(2, 0.3))
        plain_run(turn, [seconds])
    assert turn.speedup_error is None and "±" not in turn.basis()  # two steps say nothing of their spread
    turn.add(step(0, 0.3, kind="plain"))
    # step times 0.1, 0.2, 0.3 s: mean 0.2, sample variance 0.01, standard error (0.01 / 3) ** 0.5
    assert turn.speedup_error == pytest.approx((0.01 / 3) ** 0.5 / 0.2)
    assert "tokens/s ± 29 %" in turn.basis() and 'data-speedup-error="0.289"' in meter_html(turn)
    steady = TurnMeter("eagle")
    plain_run(steady, [0.25] * 4)
    assert steady.speedup_error == pytest.approx(0.0, abs=1e-6)
    assert TurnMeter("vanilla").speedup_error is None


def hiccup_turn(hiccup_at: int | None) -> TurnMeter:
    """100 rounds as the app schedules them: runs of plain steps (8 ms while settling, then 6 ms), the other rounds
    2-node trees (10 ms); round `hiccup_at` held up 44 ms."""
    turn, params = TurnMeter("eagle"), DecodeParams(plain_every=PLAIN_EVERY, plain_run=PLAIN_RUN)
    for i in range(100):
        plain = params.plain_round(i)
        seconds = (0.006 if turn.plain_streak >= SETTLING else 0.008) if plain else 0.010
        seconds += 0.044 if i == hiccup_at else 0.0
        turn.add(step(0, seconds, kind="plain") if plain else Step([1, 2], [True, False], wall_s=seconds, tree_size=2))
    return turn


def test_a_hiccup_weighs_the_same_on_a_plain_step_as_on_any_round():
    """One held-up step among ~9 plain ones would halve the baseline (the browser test's 1-in-4 failure): its
    excess is spread over the answer instead, so the × does not depend on which round the machine held up."""
    second_run = PLAIN_EVERY // 2 + PLAIN_EVERY
    quiet, on_plain, on_tree = (hiccup_turn(None), hiccup_turn(second_run + SETTLING),
                                hiccup_turn(second_run + PLAIN_RUN))
    assert quiet.hiccups == 0 and on_plain.hiccups == on_tree.hiccups == 1
    assert quiet.plain_per_s == pytest.approx(1 / 0.006)
    assert on_plain.tokens_per_s == on_tree.tokens_per_s < quiet.tokens_per_s  # what the user got, hiccup included
    slowdown = on_plain.decoding.seconds / (on_plain.decoding.seconds - 0.044)
    assert on_plain.plain_per_s == pytest.approx(1 / (0.006 * slowdown))
    assert on_plain.speedup == pytest.approx(on_tree.speedup) == pytest.approx(quiet.speedup, rel=0.07)
    assert on_plain.plain.per_s < 0.6 * on_plain.plain_per_s  # the plain steps' raw mean: what the meter showed before
    assert on_plain.speedup_error == pytest.approx(0.0, abs=1e-6)  # the steady steps agree
    assert "1 round held up by the machine" in on_plain.basis() and "held up" not in quiet.basis()
    assert f'data-plain-tps="{on_plain.plain_per_s:.3f}"' in meter_html(on_plain)


def test_rounds_are_compared_with_rounds_of_the_same_tree_size():
    """Trees of different sizes cost different times (a confidence floor varies them): a large tree is not a hiccup."""
    turn = TurnMeter("eagle")
    for size, seconds in [(0, 0.006)] * 6 + [(6, 0.020)] * 2:
        turn.add(Step([1] * (size // 2 + 1), [True] * (size // 2) + [False], wall_s=seconds, tree_size=size))
    plain_run(turn, [0.006], settling_s=0.007)
    assert turn.hiccups == 0 and turn.plain_per_s == pytest.approx(1 / 0.006)


def test_a_plain_decoding_answer_is_its_own_baseline():
    turn = TurnMeter("vanilla")
    turn.add(step(0, 1.0, kind="prefill"))
    assert turn.speedup is None
    for seconds in (0.1, 0.3):
        turn.add(step(0, seconds, kind="plain"))
    assert turn.speedup == 1.0 and turn.tau == 1.0 and "baseline itself" in turn.basis()


def test_meter_html_shows_the_figures_and_a_bar_per_round():
    turn = TurnMeter("eagle")
    turn.add(step(0, 1.0, kind="prefill"))
    runs = DecodeParams(plain_every=20, plain_run=SETTLING + 2)
    for i in range(60):
        turn.add(step(0, 0.4, kind="plain") if runs.plain_round(i) else step(i % 4, 0.25))
    html = meter_html(turn, running=True)
    assert 'data-state="decoding"' in html and 'data-rounds="60"' in html
    shown = re.search(r'data-stat="tokens/s"><span class="meter-value">(\d+\.\d)<', html).group(1)
    assert shown == f"{turn.tokens_per_s:.1f}"
    assert f"{turn.speedup:.2f}×" in html and f"{turn.tau:.2f}" in html
    assert html.count("<rect") == 48  # the chart keeps the latest rounds only
    assert "round 60: 4 tokens" in html
    assert "plain decoding (2.5 tokens/s ± 0 %)" in html and 'data-plain-steps="6"' in html  # the baseline is named
    finished = meter_html(turn)
    assert 'data-state="idle"' in finished and "stopped" in finished


def test_empty_meter_claims_nothing():
    html = meter_html(None)
    assert "×" not in html and 'data-rounds="0"' in html


def test_log_line_names_what_the_page_shows():
    turn = TurnMeter("eagle")
    turn.add(step(0, 0.2, kind="prefill"))
    turn.add(step(2, 0.3))
    plain_run(turn, [0.2])
    with_head = step(2, 0.3, finish="eos")
    with_head.with_head = True
    turn.add(with_head)
    line = turn_log_line(turn)
    assert line.startswith(f"turn: eagle, {7 + SETTLING} tokens in {3 + SETTLING} rounds")
    assert f"shown {turn.speedup:.2f}x" in line
    assert "tau 3.00" in line and "head in 1 of 2 drafting rounds" in line and "eos" in line


def test_status_line():
    assert 'data-active="0"' in status_html(12, 0) and "idle" in status_html(12, 0)
    assert "decoding (2 turns)" in status_html(40, 2) and 'data-rounds="40"' in status_html(40, 2)
