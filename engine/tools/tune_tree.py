"""Find the draft-tree settings that maximise tokens/s on this machine: `python -m engine.tools.tune_tree`.

A tree's cost is one base forward over all its nodes, which is far from free on a CPU, so the best tree is a
trade-off between acceptance (bigger trees accept more) and verification cost. Every setting and plain decoding
run on the same prompts, interleaved prompt by prompt, so the ratios hold on a noisy machine.
"""
from __future__ import annotations

import argparse
import itertools

from ..decode.params import DecodeParams
from ..draft.context import ContextDraft
from ..draft.tree import DynamicTree
from ..engine import Engine
from ..options import LoadOptions
from .bench import parse_sizes
from ..progress import progress_bar
from .report import summarize
from .runs import SHARED_QUESTIONS, first_turn_prompts, load_questions, run_engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", default=SHARED_QUESTIONS)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    LoadOptions.add_arguments(parser, only=("base", "head", "dtype", "kernels", "corpus"))
    parser.add_argument("--total-tokens", default="8,12,16,24,32", help="comma-separated values to try")
    parser.add_argument("--depth", default="3,4,5,6")
    parser.add_argument("--draft-top-k", default="4,8")
    parser.add_argument("--min-prob", default="0", help="comma-separated values to try (0: no threshold)")
    parser.add_argument("--min-match", default=str(ContextDraft.min_match),
                        help="comma-separated values to try: the shortest match of the context that drafts a chain")
    parser.add_argument("--methods", default="eagle",
                        help="eagle (the tree grid above) and/or suffix (the context alone: one tree-less setting)")
    parser.add_argument("--corpus-share", default=str(ContextDraft.corpus_share),
                        help="comma-separated values to try: the share of the replies sharing the text's end that must "
                             "agree on a token for the corpus to draft it (engine/draft/corpus.py); 'off': no corpus")
    parser.add_argument("--corpus-max-tokens", default=str(ContextDraft.corpus_max_tokens),
                        help="comma-separated values to try: the corpus's longest chain")
    return parser.parse_args(argv)


def context_grid(min_match: str, corpus_share: str, corpus_max_tokens: str) -> list[tuple[ContextDraft, bool]]:
    """(ContextDraft, whether the corpus drafts) for every combination of the comma-separated values."""
    matches = parse_sizes(min_match, "--min-match", "match lengths such as 1,2")
    longest = parse_sizes(corpus_max_tokens, "--corpus-max-tokens", "chain lengths such as 1,2")
    shares = corpus_share.split(",")
    grid = [(ContextDraft(min_match=m), False) for m in matches if "off" in shares]
    return grid + [(ContextDraft(min_match=m, corpus_share=float(share), corpus_max_tokens=k), True)
                   for m in matches for share in shares if share != "off" for k in longest]


def tree_grid(total_tokens: str, depth: str, top_k: str, min_prob: str) -> list[DynamicTree]:
    """Every combination of the comma-separated values that can fill its node budget."""
    sizes = (map(int, v.split(",")) for v in (total_tokens, depth, top_k))
    floors = [float(p) for p in min_prob.split(",")]
    fitting = [(t, d, k) for t, d, k in itertools.product(*sizes) if t - 1 <= k * (1 + d * k)]
    return [DynamicTree(t, d, k, p) for t, d, k in fitting for p in floors]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    methods = args.methods.split(",")
    if not set(methods) <= {"eagle", "suffix"}:
        raise SystemExit(f"--methods: eagle and/or suffix, got {args.methods}")
    contexts = context_grid(args.min_match, args.corpus_share, args.corpus_max_tokens)
    # Every setting prefills each prompt in full, as the first one did.
    engine = Engine.from_options(LoadOptions.from_args(args, reuse_prefixes=False))
    questions = load_questions(args.questions, args.limit)
    prompts, categories = first_turn_prompts(engine, questions), [q["category"] for q in questions]
    plain = DecodeParams(method="vanilla", max_new_tokens=args.max_new_tokens)
    trees = tree_grid(args.total_tokens, args.depth, args.draft_top_k, args.min_prob)
    shapes = [("eagle", tree) for tree in trees if "eagle" in methods] + [("suffix", None)] * ("suffix" in methods)
    settings = {"vanilla": plain} | {
        (method, tree, context, corpus): DecodeParams(method=method, max_new_tokens=args.max_new_tokens,
                                                      tree=tree or DynamicTree(), context=context, corpus=corpus)
        for (method, tree), (context, corpus) in itertools.product(shapes, contexts)}
    run_engine(engine, prompts[0], DecodeParams(max_new_tokens=8))  # warm-up
    runs = {key: [] for key in settings}
    with progress_bar(total=len(prompts) * len(runs), desc="tune") as bar:
        for prompt in prompts:
            for key, params in settings.items():
                runs[key].append(run_engine(engine, prompt, params))
                bar.update()
    plain_runs = runs.pop("vanilla")
    vanilla = summarize(plain_runs, None, categories)
    print(f"vanilla: {vanilla['tokens_per_s']:.2f} tok/s")
    print("method total_tokens depth draft_top_k min_prob min_match corpus   tok/s  x vanilla   tau  draft ms  "
          "verify ms  = vanilla")
    rows = [(summarize(r, plain_runs, categories), *key) for key, r in runs.items()]
    for s, method, tree, context, corpus in sorted(rows, key=lambda row: -row[0]["tokens_per_s"]):
        shape = (f"{tree.total_tokens:12d} {tree.depth:5d} {tree.top_k:11d} {tree.min_prob:8.2f}" if tree
                 else f"{'-':>12} {'-':>5} {'-':>11} {'-':>8}")
        drafts = f"{context.corpus_share:.2f}x{context.corpus_max_tokens}" if corpus else "off"
        print(f"{method:6s} {shape} {context.min_match:9d} {drafts:>6s} "
              f"{s['tokens_per_s']:7.2f} {s['tokens_per_s'] / vanilla['tokens_per_s']:9.2f} {s['tau']:5.2f} "
              f"{s['draft_ms']:9.1f} {s['verify_ms']:10.1f}  {s['matches_vanilla']}/{len(prompts)}")


if __name__ == "__main__":
    main()
