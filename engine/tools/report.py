"""The benchmark's figures: totals per method, tau (overall and by category), exactness against vanilla, the
printed table and the bar chart."""
from __future__ import annotations

from pathlib import Path
from typing import TextIO

from .runs import Run

COLORS = {"vanilla": "#7f7f7f", "eagle": "#d62728", "hf": "#1f77b4", "hf-pld": "#2ca02c"}


def _mean_ms(values: list[float]) -> float | None:
    return 1000 * sum(values) / len(values) if values else None


def _tau(runs: list[Run]) -> float | None:
    """New tokens per decoding forward, prefill and its token left out (engine.tools.bench)."""
    decode_forwards = sum(r.target_forwards - 1 for r in runs)
    return sum(len(r.token_ids) - 1 for r in runs) / decode_forwards if decode_forwards else None


def summarize(runs: list[Run], baseline: list[Run] | None, categories: list[str]) -> dict:
    """Totals over questions for one method; see engine.tools.bench for tau and the per-round split.

    categories[i] is question i's; tau_by_category shows what kind of text drafts well (MT-bench's first 20
    questions, the usual quick run, are all writing and roleplay).
    """
    tokens = sum(len(r.token_ids) for r in runs)
    wall = sum(r.wall_s for r in runs)
    rounds = [step for r in runs for step in r.steps[1:]]  # engine methods only
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else None,
        "tau": _tau(runs),
        "tau_by_category": {
            name: _tau([r for r, c in zip(runs, categories) if c == name]) for name in dict.fromkeys(categories)
        },
        "rounds": sum(r.target_forwards - 1 for r in runs),
        "draft_ms": _mean_ms([s.draft_s for s in rounds]),
        "verify_ms": _mean_ms([s.verify_s for s in rounds]),
        "other_ms": _mean_ms([s.wall_s - s.draft_s - s.verify_s for s in rounds]),
        "accepted_per_round": sum(s.accepted for s in rounds) / len(rounds) if rounds else None,
        "rows_per_round": sum(1 + s.tree_size for s in rounds) / len(rounds) if rounds else None,
        "matches_vanilla": (
            sum(r.token_ids == b.token_ids for r, b in zip(runs, baseline)) if baseline is not None else None
        ),
    }


def exactness_warnings(summary: dict, questions: int, exempt: set[str] = frozenset()) -> list[str]:
    """Greedy decoding is lossless only if every method reproduces vanilla's tokens on every question; `exempt`
    names methods that ran another model dtype, where no one expects the same tokens."""
    return [
        f"WARNING: {method} matched vanilla's greedy tokens on only {s['matches_vanilla']}/{questions} questions "
        "(expected all at temperature 0)"
        for method, s in summary.items()
        if s["matches_vanilla"] is not None and s["matches_vanilla"] != questions and method not in exempt
    ]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_speedups(summary: dict) -> None:
    """tokens/s of each method over vanilla's, where vanilla ran."""
    vanilla = summary.get("vanilla", {}).get("tokens_per_s")
    for s in summary.values():
        s["speedup_vs_vanilla"] = s["tokens_per_s"] / vanilla if vanilla and s["tokens_per_s"] else None


def print_table(summary: dict, questions: int, file: TextIO | None = None) -> None:
    """The summary as aligned columns on `file` (None: sys.stdout at call time), then tau by category if several."""
    rows = [("method", "tokens", "wall s", "tok/s", "x vanilla", "tau", "acc/round", "rows/round",
             "draft ms", "verify ms", "other ms", "= vanilla")]
    for method, s in summary.items():
        match = "-" if s["matches_vanilla"] is None else f"{s['matches_vanilla']}/{questions}"
        rows.append((method, str(s["tokens"]), _fmt(s["wall_s"], ".2f"), _fmt(s["tokens_per_s"], ".2f"),
                     _fmt(s.get("speedup_vs_vanilla"), ".2f"), _fmt(s["tau"], ".2f"),
                     _fmt(s["accepted_per_round"], ".2f"), _fmt(s.get("rows_per_round"), ".2f"),
                     _fmt(s["draft_ms"], ".1f"), _fmt(s["verify_ms"], ".1f"), _fmt(s["other_ms"], ".1f"), match))
    _print_rows(rows, file)
    categories = list(next(iter(summary.values())).get("tau_by_category", {}))  # absent from older JSON reports
    if len(categories) > 1:
        print("\ntau by category", file=file)
        _print_rows([("method", *categories)] + [
            (method, *(_fmt(s["tau_by_category"][c], ".2f") for c in categories)) for method, s in summary.items()
        ], file)


def _print_rows(rows: list[tuple[str, ...]], file: TextIO | None) -> None:
    """Columns padded to their widest cell: the first left-aligned, numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))),
              file=file)


def plot(summary: dict, out: str | Path, title: str) -> None:
    """Two bar panels, tokens/s and tau, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, label in zip(axes, ("tokens_per_s", "tau"), ("tokens / s", "τ (new tokens per base forward)")):
        values = [summary[m][key] or 0.0 for m in methods]
        bars = ax.bar(methods, values, color=[COLORS.get(m, "#9467bd") for m in methods])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
