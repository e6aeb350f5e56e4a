"""The speedup meter: figures from Steps, the pooled plain-decoding baseline, and the panel's HTML."""
from __future__ import annotations

import re

import pytest

from app.meter import Baseline, TurnMeter, meter_html, status_html
from engine import Step


def step(n_drafted: int, seconds: float, finish: str | None = None) -> Step:
    return Step(list(range(n_drafted + 1)), [True] * n_drafted + [False], wall_s=seconds, finish_reason=finish)


def test_turn_figures_leave_out_the_prefill():
    turn = TurnMeter("eagle")
    turn.add(step(0, 5.0), prefill=True)  # a slow prefill must not lower the decoding speed
    for drafted in (3, 0, 2):
        turn.add(step(drafted, 0.5), prefill=False)
    assert (turn.rounds, turn.tokens, turn.prefill_s) == (3, 8, 5.0)
    assert turn.tokens_per_s == pytest.approx(8 / 1.5)
    assert turn.tau == pytest.approx(8 / 3)
    assert turn.per_round == [4, 1, 3]


def test_speedup_is_against_the_measured_baseline():
    baseline = Baseline()
    turn = TurnMeter("eagle")
    turn.add(step(0, 1.0), prefill=True)
    turn.add(step(3, 0.5), prefill=False)
    assert turn.speedup(baseline) is None  # nothing measured, nothing claimed
    baseline.add(10, 2.0, "start-up calibration")
    assert turn.speedup(baseline) == pytest.approx((4 / 0.5) / 5.0)


def test_baseline_pools_tokens_and_seconds_over_a_window():
    baseline = Baseline(window=2)
    baseline.add(10, 1.0, "a")
    baseline.add(30, 1.0, "b")
    assert baseline.tokens_per_s == pytest.approx(40 / 2.0)  # pooled, not the mean of 10 and 30 tokens/s
    baseline.add(5, 5.0, "c")  # the oldest run leaves the window
    assert baseline.tokens_per_s == pytest.approx(35 / 6.0) and baseline.tokens == 35 and baseline.source == "c"
    baseline.add(0, 1.0, "empty")  # an empty run changes nothing
    assert baseline.tokens == 35 and baseline.source == "c"


def test_meter_html_shows_the_figures_and_a_bar_per_round():
    baseline = Baseline()
    baseline.add(24, 3.0, "start-up calibration")
    turn = TurnMeter("eagle")
    turn.add(step(0, 1.0), prefill=True)
    for drafted in range(60):
        turn.add(step(drafted % 4, 0.25), prefill=False)
    html = meter_html(turn, baseline, running=True)
    assert 'data-state="decoding"' in html and 'data-rounds="60"' in html
    assert re.search(r'data-stat="tokens/s"><span class="meter-value">(\d+\.\d)<', html).group(1) == f"{turn.tokens_per_s:.1f}"
    assert f"{turn.speedup(baseline):.2f}×" in html and f"{turn.tau:.2f}" in html
    assert html.count("<rect") == 48  # the chart keeps the latest rounds only
    assert "round 60: 4 tokens" in html
    assert "8.0 tokens/s" in html  # the baseline it compares against is named
    finished = meter_html(turn, baseline)
    assert 'data-state="idle"' in finished and "stopped" in finished


def test_empty_meter_claims_nothing():
    html = meter_html(None, Baseline())
    assert "×" not in html and "not measured yet" in html and 'data-rounds="0"' in html


def test_status_line():
    assert 'data-active="0"' in status_html(12, 0) and "idle" in status_html(12, 0)
    assert "decoding (2 turns)" in status_html(40, 2) and 'data-rounds="40"' in status_html(40, 2)
