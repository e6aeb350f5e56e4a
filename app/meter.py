"""The live speedup meter: tokens/s, mean accepted length τ and the speedup over plain decoding, measured.

Speeds count decoding rounds only: the prefill (prompt processing, which yields the first token) costs the same
with or without EAGLE and would blur the comparison on short answers. The plain decoding baseline is the same
model on the same machine, measured at start-up and refreshed by every plain-decoding turn.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from engine import Step

CHART_ROUNDS = 48  # rounds shown in the acceptance chart
METHOD_NAMES = {"eagle": "EAGLE", "vanilla": "Plain decoding"}
FINISH_NAMES = {"eos": "finished", "length": "token limit reached", "context": "context full"}


class Baseline:
    """Plain decoding speed pooled over the latest measurements (tokens and seconds summed, not rates averaged)."""

    def __init__(self, window: int = 8):
        self._runs: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.source = "not measured yet"

    def add(self, tokens: int, seconds: float, source: str) -> None:
        if tokens < 1 or seconds <= 0:
            return
        with self._lock:
            self._runs.append((tokens, seconds))
            self.source = source

    @property
    def tokens(self) -> int:
        with self._lock:
            return sum(tokens for tokens, _ in self._runs)

    @property
    def tokens_per_s(self) -> float | None:
        with self._lock:
            seconds = sum(s for _, s in self._runs)
            return sum(t for t, _ in self._runs) / seconds if seconds else None


@dataclass
class TurnMeter:
    """Figures of one answer, updated once per decoding round."""

    method: str
    prefill_s: float = 0.0
    rounds: int = 0  # decoding rounds after the prefill, one base-model forward each
    tokens: int = 0  # tokens those rounds committed
    seconds: float = 0.0
    per_round: list[int] = field(default_factory=list)  # tokens committed by each round (accepted drafts + 1)
    finish_reason: str | None = None

    def add(self, step: Step, prefill: bool) -> None:
        self.finish_reason = step.finish_reason
        if prefill:
            self.prefill_s = step.wall_s
            return
        self.rounds += 1
        self.tokens += len(step.tokens)
        self.seconds += step.wall_s
        self.per_round.append(len(step.tokens))

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def tau(self) -> float | None:
        """Mean tokens per base-model forward: accepted drafts plus the token the base model adds itself."""
        return self.tokens / self.rounds if self.rounds else None

    def speedup(self, baseline: Baseline) -> float | None:
        mine, plain = self.tokens_per_s, baseline.tokens_per_s
        return mine / plain if mine and plain else None


def _figure(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _chart(per_round: list[int]) -> str:
    """An inline SVG bar per recent round, its height the tokens that round committed."""
    shown = per_round[-CHART_ROUNDS:]
    if not shown:
        return '<svg class="meter-chart" viewBox="0 0 240 40" role="img" aria-label="no rounds yet"></svg>'
    top = max(max(shown), 2)
    width = 240 / CHART_ROUNDS
    bars = "".join(
        f'<rect x="{i * width:.1f}" y="{40 - 38 * n / top:.1f}" width="{width * 0.8:.1f}" height="{38 * n / top:.1f}">'
        f"<title>round {len(per_round) - len(shown) + i + 1}: {n} token{'s' if n > 1 else ''}</title></rect>"
        for i, n in enumerate(shown)
    )
    label = f"tokens per round, last {len(shown)} rounds, at most {top}"
    return f'<svg class="meter-chart" viewBox="0 0 240 40" role="img" aria-label="{label}">{bars}</svg>'


def _progress(turn: TurnMeter, running: bool) -> str:
    if running:
        return "decoding…"
    return FINISH_NAMES.get(turn.finish_reason or "", "stopped")


def meter_html(turn: TurnMeter | None, baseline: Baseline, running: bool = False) -> str:
    """The meter panel. Figures also sit in data- attributes so that tests and scripts can read them."""
    plain = baseline.tokens_per_s
    note = (
        f"Plain decoding of this model on this machine: {_figure(plain, 1)} tokens/s "
        f"({baseline.source}, {baseline.tokens} tokens)."
        if plain
        else "Plain decoding speed not measured yet."
    )
    if turn is None:
        stats = {"tokens/s": "–", "τ": "–", "speedup": "–", "rounds": "0"}
        attributes = 'data-rounds="0"'
    else:
        speedup = turn.speedup(baseline)
        stats = {
            "tokens/s": _figure(turn.tokens_per_s, 1),
            "τ": _figure(turn.tau, 2),
            "speedup": "–" if speedup is None else f"{speedup:.2f}×",
            "rounds": str(turn.rounds),
        }
        attributes = (
            f'data-method="{turn.method}" data-rounds="{turn.rounds}" data-tokens="{turn.tokens}" '
            f'data-tps="{turn.tokens_per_s or 0:.3f}" data-tau="{turn.tau or 0:.3f}" data-speedup="{speedup or 0:.3f}" '
            f'data-finish="{turn.finish_reason or ""}"'
        )
    cells = "".join(
        f'<div class="meter-stat" data-stat="{name}"><span class="meter-value">{value}</span>'
        f'<span class="meter-label">{name}</span></div>'
        for name, value in stats.items()
    )
    state = "decoding" if running else "idle"
    title = "Speedup meter" if turn is None else f"{METHOD_NAMES[turn.method]} · {_progress(turn, running)}"
    chart = _chart(turn.per_round if turn else [])
    return (
        f'<div class="meter" data-state="{state}" {attributes}><div class="meter-title">{title}</div>'
        f'<div class="meter-stats">{cells}</div>{chart}'
        f'<div class="meter-note">{note}</div></div>'
    )


def status_html(rounds: int, active: int) -> str:
    """The engine's state, read on the server: whether it decodes now, and its rounds since start-up."""
    state = f"decoding ({active} turn{'s' if active > 1 else ''})" if active else "idle"
    return (
        f'<div class="engine-status" data-active="{active}" data-rounds="{rounds}">'
        f"Engine {state} · {rounds} rounds since start-up</div>"
    )
