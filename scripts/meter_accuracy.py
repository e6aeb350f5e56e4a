"""How far the app's speedup meter is from the speedup it claims to measure, on the default engine without a page.

For each prompt (the bicycle prompt of the browser test, then MT-bench first turns): plain decoding, an EAGLE answer
as the app decodes it (the meter's runs of plain steps), plain decoding again, EAGLE without plain steps; prints the
ratio of the EAGLE answer's tokens/s to the two plain answers' mean beside the × the meter shows, and what the runs
cost the answer against EAGLE without them. Then, with runs of 8 plain steps, how long each step of a run took
against plain decoding's median step on the same prompt: why the meter leaves the first app.meter.SETTLING steps of
a run untimed.

    python -m scripts.meter_accuracy [--prompts 6] [--max-new-tokens 512]

Run it on a quiet machine: the ratios compare answers timed one after the other.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from statistics import mean, median

from app.meter import PLAIN_EVERY, PLAIN_RUN, TurnMeter
from engine import DecodeParams, Engine
from engine.engine import freeze_heap
from engine.tools.runs import SHARED_QUESTIONS, load_questions

BICYCLE = "Explain how a bicycle works, step by step."
LONG_RUN = 8


def answer(engine: Engine, ids: list[int], params: DecodeParams) -> TurnMeter:
    turn = TurnMeter(params.method)
    for step in engine.generate(ids, params):
        turn.add(step)
    return turn


def meter_against_ratio(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Prints the shown × over the measured ratio, and the metered answer's speed over the unmetered one's."""
    plain = DecodeParams(method="vanilla", max_new_tokens=max_new_tokens)
    eagle = DecodeParams(max_new_tokens=max_new_tokens)
    metered = replace(eagle, plain_every=PLAIN_EVERY, plain_run=PLAIN_RUN)
    errors, costs = [], []
    print("prompt  tokens  ratio  shown  timed plain steps  shown/ratio  metered/unmetered")
    for number, ids in enumerate(prompts, start=1):
        before, turn, after = answer(engine, ids, plain), answer(engine, ids, metered), answer(engine, ids, plain)
        if turn.speedup is None:  # over before a run's settled steps: no × to compare
            print(f"{number:6d}  {turn.tokens:6d}  no plain step timed in {turn.rounds} rounds")
            continue
        ratio = turn.tokens_per_s / mean([before.tokens_per_s, after.tokens_per_s])
        errors.append(turn.speedup / ratio)
        costs.append(turn.tokens_per_s / answer(engine, ids, eagle).tokens_per_s)
        print(f"{number:6d}  {turn.tokens:6d}  {ratio:5.2f}  {turn.speedup:5.2f}  {turn.plain.steps:17d}  "
              f"{errors[-1]:11.2f}  {costs[-1]:17.2f}")
    if errors:
        print(f"mean shown/ratio {mean(errors):.3f} (min {min(errors):.2f}, max {max(errors):.2f}); "
              f"mean metered/unmetered {mean(costs):.3f}")


def settling(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Prints the median time of the k-th step of a run of LONG_RUN plain steps over plain decoding's median step."""
    by_place: list[list[float]] = [[] for _ in range(LONG_RUN)]
    runs = DecodeParams(max_new_tokens=max_new_tokens, plain_every=4 * LONG_RUN, plain_run=LONG_RUN)
    for ids in prompts:
        plain = median(s.verify_s for s in engine.generate(ids, method="vanilla", max_new_tokens=max_new_tokens)
                       if s.kind == "plain")
        place = 0
        for step in engine.generate(ids, runs):
            if step.kind == "plain":
                by_place[place].append(step.verify_s / plain)
            place = place + 1 if step.kind == "plain" else 0
    factors = [median(times) for times in by_place]
    print("k-th plain step of a run / plain decoding's step: "
          + " ".join(f"{k}: {f:.2f}" for k, f in enumerate(factors, start=1)))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.meter_accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="the bicycle prompt, then MT-bench first turns")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    args = parser.parse_args()
    engine = Engine.load(reuse_prefixes=False)  # every answer prefills in full, as a fresh chat does
    freeze_heap()
    texts = [BICYCLE] + [q["turns"][0] for q in load_questions(SHARED_QUESTIONS, limit=max(0, args.prompts - 1))]
    prompts = [engine.encode_chat([{"role": "user", "content": text}]) for text in texts[: args.prompts]]
    meter_against_ratio(engine, prompts, args.max_new_tokens)
    settling(engine, prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
