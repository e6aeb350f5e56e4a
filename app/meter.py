"""The live speedup meter: tokens/s, mean accepted length τ and the speedup over plain decoding, all measured in
the answer it describes.

The baseline is not a figure from another time: an EAGLE answer decodes a run of PLAIN_RUN plain steps every
PLAIN_EVERY rounds (DecodeParams.plain_every, the first run half a period in), under whatever else the machine is
doing at that moment, and the speedup divides the answer's speed (those steps included: what the user gets) by
the speed of the runs' last steps. The first SETTLING steps of a run are not timed: a step right after drafting
rounds runs slower than one after other plain steps (docs/benchmarks.md, "The speedup meter's accuracy":
slower at first, as fast within a few steps), and plain decoding is nothing but steps after plain steps. A
plain-decoding answer is its own baseline: 1.00×. Speeds count decoding rounds only: the prefill (prompt
processing) costs the same with or without EAGLE.

A hiccup (a step the machine held up, e.g. while the browser repaints) lands on one of an answer's few timed plain
steps as often as on any round, but there it moves the baseline by a third or more: a hiccup's excess time is
taken out of the plain step it hit and spread over the whole answer, so that it slows both sides alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean, median, stdev

from markdown_it.common.utils import escapeHtml

from engine import Step

from .figures import FINISH_NAMES, METHOD_NAMES, figures_line

PLAIN_EVERY = 40  # a run of plain steps every 40 rounds: 1 round in 5 plain, 1 in 10 timed
PLAIN_RUN = 8
SETTLING = 4  # untimed plain steps at the start of a run
HICCUP = 2.0  # a step over twice its kind's median time was held up by the machine, not slowed by the method
CHART_ROUNDS = 48  # rounds shown in the acceptance chart


@dataclass
class Rate:
    """Tokens and the seconds each step took (rates come from sums, not from averaging rates)."""

    tokens: int = 0
    times: list[float] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)  # steps of one group do the same work (a tree's size)
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float, group: int = 0) -> None:
        self.tokens += tokens
        self.times.append(seconds)
        self.groups.append(group)
        self.seconds += seconds

    @property
    def steps(self) -> int:
        return len(self.times)

    @property
    def per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def steady_times(self) -> list[float]:
        """Step times with each hiccup (over HICCUP × the median of its group, from 3 steps on) cut to that
        median."""
        typical = {}
        for group in set(self.groups):
            times = [t for t, g in zip(self.times, self.groups) if g == group]
            typical[group] = median(times) if len(times) >= 3 else float("inf")
        return [typical[g] if t > HICCUP * typical[g] else t for t, g in zip(self.times, self.groups)]

    def hiccup_seconds(self) -> float:
        """The hiccups' excess over their medians: exactly 0 when there is none."""
        return sum(t - steady for t, steady in zip(self.times, self.steady_times()))


def relative_error(times: list[float]) -> float | None:
    """Standard error of the mean step time over the mean, from 3 steps on: how far a rate measured on this few
    steps may be off (steps of equal work vary ~15-30 % here with what the machine does meanwhile)."""
    if len(times) < 3 or sum(times) <= 0:
        return None
    return stdev(times) / len(times) ** 0.5 / mean(times)


@dataclass
class TurnMeter:
    """Figures of one answer, updated once per decoding round."""

    method: str
    prefill_s: float = 0.0  # the prompt's forward, which also gives the first token: the time to the first token
    first_tokens: int = 0  # tokens the prefill gave (one)
    decoding: Rate = field(default_factory=Rate)  # every round after the prefill: what the user gets
    speculative: Rate = field(default_factory=Rate)  # rounds that verified a drafted tree
    plain: Rate = field(default_factory=Rate)  # settled plain steps, timed as plain decoding (drafter upkeep left out)
    per_round: list[int] = field(default_factory=list)  # tokens committed by each round (accepted drafts + 1)
    head_rounds: int = 0  # speculative rounds the draft head took part in (the head gate may rest it)
    drafted: int = 0  # drafted tokens the base model verified, the head's and the context's (llama.cpp's draft_n)
    accepted: int = 0  # of those, the ones kept (llama.cpp's draft_n_accepted)
    finish_reason: str | None = None
    plain_streak: int = 0  # plain steps in a row up to the last one added

    def add(self, step: Step) -> None:
        self.finish_reason = step.finish_reason
        if step.kind == "prefill":  # the prompt's forward, which also gives the first token
            self.prefill_s, self.first_tokens = step.wall_s, len(step.tokens)
            return
        self.drafted += step.tree_size
        self.accepted += step.accepted
        self.decoding.add(len(step.tokens), step.wall_s)
        self.plain_streak = self.plain_streak + 1 if step.kind == "plain" else 0
        if self.plain_streak > SETTLING:
            self.plain.add(len(step.tokens), step.wall_s - step.draft_s)
        elif step.kind != "plain":
            self.speculative.add(len(step.tokens), step.wall_s, group=step.tree_size)
            self.head_rounds += step.with_head
        self.per_round.append(len(step.tokens))

    @property
    def rounds(self) -> int:
        return self.decoding.steps

    @property
    def tokens(self) -> int:
        return self.decoding.tokens

    @property
    def tokens_per_s(self) -> float | None:
        return self.decoding.per_s

    @property
    def tau(self) -> float | None:
        """Mean tokens per drafting round: accepted drafts plus the token the base model adds itself (plain
        decoding: 1)."""
        rounds = self.speculative if self.speculative.steps else self.decoding
        return rounds.tokens / rounds.steps if rounds.steps else None

    @property
    def plain_per_s(self) -> float | None:
        """The baseline: the plain steps' tokens/s under this answer's conditions. Their hiccups' excess is spread
        over the whole answer: each step costs its steady mean × (the answer's time ÷ its time without hiccups)."""
        if not self.plain.steps:
            return None
        hiccups = self.speculative.hiccup_seconds() + self.plain.hiccup_seconds()
        slowdown = self.decoding.seconds / (self.decoding.seconds - hiccups) if hiccups else 1.0
        step_s = mean(self.plain.steady_times()) * slowdown
        return self.plain.tokens / self.plain.steps / step_s if step_s > 0 else None

    @property
    def hiccups(self) -> int:
        """Rounds the machine held up (over HICCUP × their kind's median), plain steps and drafting rounds."""
        return sum(t != s for rate in (self.plain, self.speculative) for t, s in zip(rate.times, rate.steady_times()))

    def summary(self) -> dict:
        """The answer's figures as plain values, kept with the reply and sent with it (chat history, export, API)."""
        return {"method": self.method, "tokens": self.first_tokens + self.tokens,
                "tokens_per_s": _rounded(self.tokens_per_s, 2), "tau": _rounded(self.tau, 3),
                "accepted": self.accepted, "drafted": self.drafted, "speedup": _rounded(self.speedup, 3),
                "ttft_s": _rounded(self.prefill_s, 4), "finish": self.finish_reason}

    @property
    def speedup(self) -> float | None:
        """The answer's tokens/s (the figure shown, its own plain steps included) over its plain steps' tokens/s; 1
        for plain decoding."""
        if self.method == "vanilla":
            return 1.0 if self.rounds else None
        fast, plain = self.decoding.per_s, self.plain_per_s
        return fast / plain if fast and plain else None

    @property
    def speedup_error(self) -> float | None:
        """± on the speedup, relative: the plain baseline is a sample of a few steps, the answer's speed is not."""
        return relative_error(self.plain.steady_times()) if self.method != "vanilla" else None

    def basis(self) -> str:
        """What the × compares, in words."""
        if self.method == "vanilla":
            return "Plain decoding is the baseline itself: 1.00×."
        if not self.plain.steps:
            return "× appears once a plain decoding step has been timed in this answer."
        error = self.speedup_error
        spread = "" if error is None else f" ± {100 * error:.0f} %"
        basis = (f"× = this answer ({_figure(self.decoding.per_s, 1)} tokens/s) ÷ plain decoding "
                 f"({_figure(self.plain_per_s, 1)} tokens/s{spread}), both timed in this answer: {self.plain.steps} "
                 f"plain step{'s' if self.plain.steps > 1 else ''}, the last {PLAIN_RUN - SETTLING} of a run of "
                 f"{PLAIN_RUN} every {PLAIN_EVERY} rounds (the first ones let the machine settle after drafting).")
        if spread:
            basis += " ± is the standard error of the plain steps' mean."
        if self.hiccups:
            basis += (f" {self.hiccups} round{'s' if self.hiccups > 1 else ''} held up by the machine (over "
                      f"{HICCUP:.0f}× the usual time) count against both speeds alike.")
        return basis


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


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


def meter_html(turn: TurnMeter | None, running: bool = False) -> str:
    """The meter panel. Figures also sit in data- attributes so that tests and scripts can read them."""
    if turn is None:
        stats = {"tokens/s": "–", "τ": "–", "speedup": "–", "rounds": "0"}
        attributes, note = 'data-rounds="0"', "Ask something: the figures are measured as the answer is written."
    else:
        speedup = turn.speedup
        stats = {
            "tokens/s": _figure(turn.tokens_per_s, 1),
            "τ": _figure(turn.tau, 2),
            "speedup": "–" if speedup is None else f"{speedup:.2f}×",
            "rounds": str(turn.rounds),
        }
        attributes = (
            f'data-method="{turn.method}" data-rounds="{turn.rounds}" data-tokens="{turn.tokens}" '
            f'data-tps="{turn.tokens_per_s or 0:.3f}" data-tau="{turn.tau or 0:.3f}" data-speedup="{speedup or 0:.3f}" '
            f'data-plain-tps="{turn.plain_per_s or 0:.3f}" data-plain-steps="{turn.plain.steps}" '
            f'data-speedup-error="{turn.speedup_error or 0:.3f}" '
            f'data-finish="{turn.finish_reason or ""}"'
        )
        note = turn.basis()
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


def turn_log_line(turn: TurnMeter) -> str:
    """One line per answer for the server log: what an operator needs to see the engine's state."""
    speedup = "–" if turn.speedup is None else f"{turn.speedup:.2f}x"
    if turn.speedup_error is not None:
        speedup += f" ± {100 * turn.speedup_error:.0f} %"
    return (f"turn: {turn.method}, {turn.tokens} tokens in {turn.rounds} rounds, "
            f"{_figure(turn.tokens_per_s, 1)} tok/s, tau {_figure(turn.tau, 2)}, "
            f"head in {turn.head_rounds} of {turn.speculative.steps} drafting rounds, "
            f"plain {_figure(turn.plain_per_s, 1)} tok/s over {turn.plain.steps} steps, "
            f"{turn.hiccups} held up, "
            f"shown {speedup}, prefill {turn.prefill_s * 1000:.0f} ms, {turn.finish_reason or 'stopped'}")


def figures_html(figures: dict) -> str:
    """A finished answer's figures under it, collapsed to one line until opened (the `data-` attributes of the meter do
    not survive the chat's HTML sanitizer, so the figures are in the text and the element's title)."""
    line = figures_line(figures)
    return (f'<details class="reply-figures"><summary title="{escapeHtml(line)}">{escapeHtml(_headline(figures))}'
            f'</summary><p>{escapeHtml(line)}</p></details>')


def _headline(figures: dict) -> str:
    speed = figures.get("tokens_per_s")
    speedup = figures.get("speedup")
    parts = [METHOD_NAMES.get(figures.get("method", ""), figures.get("method") or "?"),
             "" if speed is None else f"{speed:.1f} tokens/s", "" if speedup is None else f"{speedup:.2f}×"]
    return " · ".join(p for p in parts if p)


def status_html(rounds: int, active: int) -> str:
    """The engine's state, read on the server: whether it decodes now, and its rounds since start-up."""
    state = f"decoding ({active} turn{'s' if active > 1 else ''})" if active else "idle"
    return (
        f'<div class="engine-status" data-active="{active}" data-rounds="{rounds}">'
        f"Engine {state} · {rounds} rounds since start-up</div>"
    )
