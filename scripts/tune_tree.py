"""Find the draft-tree settings that maximise tokens/s on this machine: `python scripts/tune_tree.py`.

A tree's cost is one base forward over all its nodes, which is far from free on a CPU, so the best tree is a
trade-off between acceptance (bigger trees accept more) and verification cost. Every setting and plain decoding
run on the same prompts, interleaved prompt by prompt, so the ratios hold on a noisy machine.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine  # noqa: E402
from engine.bench import SHARED_QUESTIONS, load_questions, run_engine, summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", default=SHARED_QUESTIONS)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--base", default=None)
    parser.add_argument("--head", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--total-tokens", default="8,12,16,24,32", help="comma-separated values to try")
    parser.add_argument("--depth", default="3,4,5,6")
    parser.add_argument("--draft-top-k", default="4,8")
    args = parser.parse_args()

    engine = Engine.load(args.base, args.head, dtype=args.dtype)
    questions = load_questions(args.questions, args.limit)
    prompts = [engine.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in questions]
    categories = [q["category"] for q in questions]
    grid = [dict(total_tokens=t, depth=d, draft_top_k=k) for t, d, k in itertools.product(
        *(map(int, v.split(",")) for v in (args.total_tokens, args.depth, args.draft_top_k)))]
    grid = [g for g in grid if g["total_tokens"] - 1 <= g["draft_top_k"] * (1 + g["depth"] * g["draft_top_k"])]
    base = dict(max_new_tokens=args.max_new_tokens)
    run_engine(engine, "eagle", prompts[0], {**base, "max_new_tokens": 8})  # warm-up
    runs = {"vanilla": []} | {i: [] for i in range(len(grid))}
    with tqdm(total=len(prompts) * len(runs), desc="tune") as bar:
        for prompt in prompts:
            for key in runs:
                method, params = ("vanilla", base) if key == "vanilla" else ("eagle", {**base, **grid[key]})
                runs[key].append(run_engine(engine, method, prompt, params))
                bar.update()
    vanilla = summarize(runs["vanilla"], None, categories)
    print(f"vanilla: {vanilla['tokens_per_s']:.2f} tok/s")
    print("total_tokens depth draft_top_k   tok/s  x vanilla   tau  draft ms  verify ms  = vanilla")
    rows = []
    for i, setting in enumerate(grid):
        s = summarize(runs[i], runs["vanilla"], categories)
        rows.append((s["tokens_per_s"], setting, s))
    for speed, setting, s in sorted(rows, key=lambda r: -r[0]):
        print(f"{setting['total_tokens']:12d} {setting['depth']:5d} {setting['draft_top_k']:11d} {speed:7.2f} "
              f"{speed / vanilla['tokens_per_s']:9.2f} {s['tau']:5.2f} {s['draft_ms']:9.1f} {s['verify_ms']:10.1f}"
              f"  {s['matches_vanilla']}/{len(prompts)}")


if __name__ == "__main__":
    main()
