"""Plot τ against training tokens for every head trained so far (assets/training-tau.png), to size the next budget.

The figures are the recorded results of the project's training runs (the tables below), not measured here. Training
tokens = optimizer steps x 1,024 padded tokens per step, counted along the head's lineage: each fine-tuning run
(fit --init) starts where its parent stopped. Validation τ is the expected accepted length of a greedy draft chain on
held-out self-distilled conversations (4 TTT steps unless said); each run held out its own set, so a run's first point
(its parent on the new set) is where its curve starts. MT-bench τ is measured by the engine (first 20 questions, 128
new tokens), with the tree in use when the head was trained.

    python -m engine.train.plot [--out assets/training-tau.png]
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TOKENS_PER_STEP = 1024

# (label, steps before this run along the lineage, [(step in the run, validation chain τ)])
VALIDATION = [
    ("first head: 4,480 convs, 24 held out", 0,
     [(60, 1.17), (240, 1.32), (540, 1.41), (600, 1.38), (960, 1.46), (1466, 1.52), (1680, 1.52), (2021, 1.55)]),
    ("fine-tuned: 1,568 convs, 40 held out", 2021,
     [(0, 1.70), (250, 1.67), (500, 1.76), (1000, 1.74), (1161, 1.76)]),
    ("fine-tuned: 3,000 convs, 75 held out", 3182, [(0, 1.84), (200, 1.75), (400, 1.84), (600, 1.88), (709, 1.90)]),
    ("fine-tuned: 3,320 convs, 83 held out, 3-step chain", 3891,
     [(300, 1.78), (600, 1.81), (900, 1.83), (1200, 1.83), (1500, 1.84), (1800, 1.86), (2100, 1.88), (2400, 1.89),
      (2700, 1.90), (2815, 1.90)]),
    ("the previous head and this one on those 83, 4-step chain", 3891, [(0, 1.88), (2815, 1.98)]),
    ("fine-tuned: 2,000 int8-model convs, 50 held out, 3-step chain", 6706,
     [(0, 2.03), (200, 1.96), (400, 2.01), (600, 2.04), (794, 2.04)]),
    ("the same on int8 features, lr 1e-4 (GRIFFIN mask alike)", 6706,
     [(0, 2.03), (100, 2.03), (200, 2.03), (300, 2.04), (328, 2.04)]),
    ("fine-tuned: 20,296 int8-model convs, the same 50 held out, 3-step chain", 6706,
     [(0, 2.03), (300, 1.89), (600, 1.93), (900, 1.93), (1200, 1.98), (1500, 2.02), (1800, 2.04), (2100, 2.05),
      (2400, 2.06), (2655, 2.07)]),
    ("again on that data, seed 1, lr 2e-4 (not shipped), 3-step chain", 6706 + 2655,
     [(0, 2.07), (300, 2.03), (600, 2.03), (900, 2.02), (1200, 2.07), (1500, 2.08), (1800, 2.10), (2100, 2.13),
      (2400, 2.10), (2700, 2.12), (3300, 2.13), (3632, 2.14)]),
    ("from scratch: 1,568 convs, 40 held out", 0, [(484, 1.43)]),
]
# (tree total/depth/top-k, [(lineage steps, MT-bench τ)])
MT_BENCH = [
    ("24 / 5 / 8", [(540, 1.80)]),
    ("12 / 3 / 8", [(2021, 1.89), (3182, 1.91), (3891, 1.95)]),
    ("12 / 3 / 8, from scratch", [(484, 1.67)]),
    ("8 / 2 / 8 (float kernels)", [(3891, 1.91), (6706, 1.96)]),
    ("2 / 1 / 2 (int8 kernels, default now)", [(6706, 1.73), (6706 + 334, 1.74), (6706 + 2655, 1.75),
                                                (6706 + 2655 + 3632, 1.74)]),
    ("8 / 2 / 8 (int8 kernels)", [(6706, 2.36), (6706 + 2655, 2.40), (6706 + 2655 + 3632, 2.40)]),
]
TREND = 3  # the series the trend is drawn from: the default tree of the float kernels, at the shipped head's steps
TARGET_TAU = 2.5


def millions(steps: int) -> float:
    return steps * TOKENS_PER_STEP / 1e6


def per_doubling(points: list[tuple[int, float]]) -> float:
    """τ gained per doubling of training tokens between the first and the last point."""
    (s0, t0), (s1, t1) = points[0], points[-1]
    return (t1 - t0) / math.log2(s1 / s0)


def plot(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(11.5, 4.8), dpi=100)
    for label, offset, points in VALIDATION:
        ax.plot([millions(offset + s) for s, _ in points], [t for _, t in points], "o-", ms=3.5, lw=1.2,
                label=f"validation: {label}")
    for (tree, points), marker in zip(MT_BENCH, "s^DvPX", strict=True):
        ax.plot([millions(s) for s, _ in points], [t for _, t in points], marker, ms=7, mfc="none", mew=1.6,
                color="black", label=f"MT-bench τ, tree {tree}")
    trend = MT_BENCH[TREND][1]
    slope = per_doubling(trend)
    (s1, t1) = trend[-1]
    reach = millions(s1) * 2 ** ((TARGET_TAU - t1) / slope)
    ax.plot([millions(s1), reach], [t1, TARGET_TAU], ":", color="gray",
            label=f"MT-bench trend: +{slope:.2f} τ per doubling")
    ax.axhline(TARGET_TAU, color="gray", lw=0.8, ls="--")
    ax.text(300, TARGET_TAU + 0.02, f"goal τ {TARGET_TAU}", color="gray", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens along the head's lineage (millions, steps x 1,024; log scale)")
    ax.set_ylabel("τ (accepted tokens per round)")
    ax.set_title("SmolLM2-135M EAGLE-3 head: τ against training tokens", fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_ylim(1.1, 2.65)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"{out}: MT-bench τ +{slope:.3f} per doubling of training tokens with the {MT_BENCH[TREND][0]} tree; "
          f"at that rate τ {TARGET_TAU} needs ~{reach:.0f} M tokens ({reach / millions(s1):.0f}x the shipped head's)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.train.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "assets" / "training-tau.png"))
    plot(Path(parser.parse_args().out))


if __name__ == "__main__":
    main()
