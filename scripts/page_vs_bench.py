"""How fast the page decodes against the bench, for one prompt: a plain and an EAGLE answer in the real app
(`python app.py`, headless Chromium on the same machine), then the bench on that prompt with the browser closed,
and again for each pair. Taking the two in turn compares them at the same hour: within minutes, this machine's
speed drifts by more than the gap being measured.

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

from playwright.sync_api import Playwright, sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.browser import (  # noqa: E402
    ROOT, answer_afresh, launch_chromium, open_app, set_number, start_app, stop_app,
)

PROMPT = "Explain how a bicycle works, step by step."
# bench method: the page's label for it (the page's EAGLE has its head gate on, as the app's settings start)
METHODS = {"vanilla": "Plain decoding", "eagle-gated": "EAGLE"}


def page_speeds(playwright: Playwright, url: str, prompt: str, max_new_tokens: int) -> dict[str, float]:
    """The meter's tokens/s for one answer by each method, in a browser opened for them and closed after."""
    browser = launch_chromium(playwright)
    try:
        page = open_app(browser, url)
        set_number(page, "max-new-tokens", max_new_tokens)
        return {method: float(answer_afresh(page, label, prompt)["tps"]) for method, label in METHODS.items()}
    finally:
        browser.close()


def bench_speeds(prompt: str, max_new_tokens: int, folder: Path) -> dict[str, float]:
    """`python -m engine.bench` on the prompt alone: tokens/s by method."""
    questions, out = folder / "question.jsonl", folder / "bench.json"
    questions.write_text(json.dumps({"question_id": 1, "category": "page", "turns": [prompt]}) + "\n")
    subprocess.run([sys.executable, "-m", "engine.bench", "--questions", str(questions), "--max-new-tokens",
                    str(max_new_tokens), "--methods", ",".join(METHODS), "--json", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["summary"]
    return {method: summary[method]["tokens_per_s"] for method in METHODS}


def measure(prompt: str, max_new_tokens: int, pairs: int, folder: Path) -> list[dict[str, tuple[float, float]]]:
    """For each pair, by method: (page tokens/s, bench tokens/s). The app waits idle while the bench runs."""
    process, url = start_app("--max-new-tokens", str(max_new_tokens), log=folder / "app.log")
    try:
        with sync_playwright() as playwright:
            rows = []
            for _ in range(pairs):
                page = page_speeds(playwright, url, prompt, max_new_tokens)
                bench = bench_speeds(prompt, max_new_tokens, folder)
                rows.append({method: (page[method], bench[method]) for method in METHODS})
            return rows
    finally:
        stop_app(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=3, help="plain and EAGLE answers taken in turn, this many each")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    rows = measure(args.prompt, args.max_new_tokens, args.pairs, Path(tempfile.mkdtemp()))
    print(f"{'method':11} {'page / bench tok/s, each pair':>44} {'page':>7} {'bench':>7} {'page/bench':>10}")
    for method in METHODS:
        each = "  ".join(f"{row[method][0]:.1f}/{row[method][1]:.1f}" for row in rows)
        page, bench = (mean(row[method][i] for row in rows) for i in (0, 1))
        print(f"{method:11} {each:>44} {page:7.1f} {bench:7.1f} {page / bench:10.0%}")


if __name__ == "__main__":
    main()
