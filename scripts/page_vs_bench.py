"""How fast the page decodes against the bench, for one prompt: plain and EAGLE answers taken in turn in the real
app (`python app.py`, headless Chromium on the same machine), then the bench on that prompt once the app is gone.

    python scripts/page_vs_bench.py [--max-new-tokens 512] [--pairs 3] [--prompt TEXT]

The page's tokens/s are the meter's (decoding rounds; the prefill left out), the bench's its own (the prefill
included, a few tens of ms an answer): issue #13 asks the page for ≥ 90 % of the bench. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.browser import (  # noqa: E402
    ROOT, answer_afresh, launch_chromium, open_app, set_number, start_app, stop_app,
)

PROMPT = "Explain how a bicycle works, step by step."
METHODS = {"vanilla": "Plain decoding", "eagle": "EAGLE"}  # bench method: the page's label for it


def page_speeds(prompt: str, max_new_tokens: int, pairs: int, folder: Path) -> dict[str, list[float]]:
    """The meter's tokens/s for each answer, by bench method name."""
    process, url = start_app("--max-new-tokens", str(max_new_tokens), log=folder / "app.log")
    try:
        with sync_playwright() as playwright:
            page = open_app(launch_chromium(playwright), url)
            set_number(page, "max-new-tokens", max_new_tokens)
            speeds: dict[str, list[float]] = {method: [] for method in METHODS}
            for _ in range(pairs):
                for method, label in METHODS.items():
                    speeds[method].append(float(answer_afresh(page, label, prompt)["tps"]))
            return speeds
    finally:
        stop_app(process)


def bench_speeds(prompt: str, max_new_tokens: int, folder: Path) -> dict[str, float]:
    """`python -m engine.bench` on the prompt alone: tokens/s by method."""
    questions, out = folder / "question.jsonl", folder / "bench.json"
    questions.write_text(json.dumps({"question_id": 1, "category": "page", "turns": [prompt]}) + "\n")
    subprocess.run([sys.executable, "-m", "engine.bench", "--questions", str(questions), "--max-new-tokens",
                    str(max_new_tokens), "--methods", ",".join(METHODS), "--json", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["summary"]
    return {method: summary[method]["tokens_per_s"] for method in METHODS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=3, help="plain and EAGLE answers taken in turn, this many each")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    page = page_speeds(args.prompt, args.max_new_tokens, args.pairs, folder)
    bench = bench_speeds(args.prompt, args.max_new_tokens, folder)
    print(f"{'method':8} {'page tok/s (each answer)':>32} {'mean':>7} {'bench':>7} {'page/bench':>10}")
    for method in METHODS:
        each, shown = " / ".join(f"{speed:.1f}" for speed in page[method]), mean(page[method])
        print(f"{method:8} {each:>32} {shown:7.1f} {bench[method]:7.1f} {shown / bench[method]:10.0%}")


if __name__ == "__main__":
    main()
