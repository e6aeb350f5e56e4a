"""Time to a chat turn's first token with the engine's kept prefixes (engine/decode/prefixes.py) and without: the same
multi-turn chat twice on the default engine, each turn's prompt the whole conversation so far, greedy; prints the
prefill of every turn both ways and whether the answers agree token for token.

    python -m scripts.chat_turns [--max-new-tokens 256]
"""
from __future__ import annotations

import argparse
import sys

from engine.engine import Engine, freeze_heap

QUESTIONS = ["Explain how a bicycle works, step by step.", "Now explain its gears in detail.",
             "What maintenance does the chain need?", "Compare it with an electric bicycle.",
             "Summarise everything above in a list.", "Which parts wear out first?"]


def chat(engine: Engine, max_new_tokens: int, keep: bool) -> list[tuple[int, float, list[int]]]:
    """(prompt tokens, prefill ms, answer ids) for each turn of QUESTIONS; keep=False forgets the kept prefixes
    before every turn, so each prefills its whole prompt."""
    messages, turns = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        ids = engine.encode_chat(messages)
        if not keep:
            engine.prefixes.entries.clear()
        steps = list(engine.generate(ids, method="vanilla", max_new_tokens=max_new_tokens))
        answer = [token for step in steps for token in step.tokens]
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(answer, skip_special_tokens=True)})
        turns.append((len(ids), steps[0].wall_s * 1000, answer))
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.chat_turns", description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    engine = Engine.load()
    freeze_heap()
    if engine.prefixes is None:
        sys.exit("this engine is not batch-invariant: it keeps no prefixes")
    kept = chat(engine, args.max_new_tokens, keep=True)
    full = chat(engine, args.max_new_tokens, keep=False)
    print("turn  prompt tokens  prefill kept ms  prefill full ms  same answer")
    for turn, ((tokens, kept_ms, ours), (_, full_ms, theirs)) in enumerate(zip(kept, full), start=1):
        print(f"{turn:4d}  {tokens:13d}  {kept_ms:15.1f}  {full_ms:15.1f}  {ours == theirs}")


if __name__ == "__main__":
    main()
