"""How fast the page decodes against the bench, for one prompt: a plain and an EAGLE answer in the real app
(`python app.py`, headless Chromium on the same machine), then the bench on that prompt with the browser closed,
and again for each pair. Taking the two in turn compares them at the same hour: within minutes, this machine's
speed drifts by more than the gap being measured.

    python -m scripts.page_vs_bench [--max-new-tokens 512] [--pairs 3] [--prompt TEXT]

The page's tokens/s are the meter's (decoding rounds; the prefill left out), the bench's its own (the prefill
included): the page should come close to the bench, since both run the same engine. Run it on a quiet machine.

The browser shares the decoder's cores: the CPU Chromium's processes use during each answer is measured, and the
bench runs once more beside a synthetic load of that share (`engine.bench --busy`), which tells what the browser's
share of the cores costs the decoder from what the app's own streaming costs it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import psutil
from playwright.sync_api import Page, Playwright, sync_playwright

from app.browser import (
    ROOT, choose_method, clear_chat, launch_chromium, meter, open_app, send, set_number, start_app, stop_app,
    wait_for_answer,
)

PROMPT = "Explain how a bicycle works, step by step."
# bench method: the page's label for it (the page's EAGLE has its head gate on, as the app's settings start)
METHODS = {"vanilla": "Plain decoding", "eagle-gated": "EAGLE"}


def browser_cpu_s() -> float:
    """CPU seconds Chromium's processes (this script's descendants) have used so far."""
    total = 0.0
    for process in psutil.Process().children(recursive=True):
        try:
            if process.name().startswith("chrom"):
                times = process.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:  # a helper process that just ended
            pass
    return total


def settle(quiet_share: float = 0.1, window_s: float = 0.5, timeout_s: float = 20) -> None:
    """Wait until Chromium, having just loaded the page, uses under `quiet_share` of a core: a user reads the page
    and types for seconds before the first answer, while an answer sent at once would share the cores with the
    page's loading and run markedly slower."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        cpu = browser_cpu_s()
        time.sleep(window_s)
        if browser_cpu_s() - cpu < quiet_share * window_s:
            return


def answer(page: Page, label: str, prompt: str) -> tuple[float, float]:
    """One answer afresh: (the meter's tokens/s, the cores Chromium used while it streamed)."""
    clear_chat(page)
    choose_method(page, label)
    cpu, wall = browser_cpu_s(), time.perf_counter()
    wait_for_answer(page, send(page, prompt), timeout_s=300)
    share = (browser_cpu_s() - cpu) / (time.perf_counter() - wall)
    return float(meter(page)["tps"]), share


def page_speeds(playwright: Playwright, url: str, prompt: str, max_new_tokens: int) -> dict[str, tuple[float, float]]:
    """By method, (tokens/s, browser cores) for one answer each, in a browser opened for them and closed after."""
    browser = launch_chromium(playwright)
    try:
        page = open_app(browser, url)
        set_number(page, "max-new-tokens", max_new_tokens)
        settle()
        return {method: answer(page, label, prompt) for method, label in METHODS.items()}
    finally:
        browser.close()


def bench_speeds(prompt: str, max_new_tokens: int, folder: Path, methods: list[str], busy: float = 0) -> dict:
    """`python -m engine.bench` on the prompt alone, beside `busy` cores of load: tokens/s by method."""
    questions, out = folder / "question.jsonl", folder / "bench.json"
    questions.write_text(json.dumps({"question_id": 1, "category": "page", "turns": [prompt]}) + "\n")
    subprocess.run([sys.executable, "-m", "engine.bench", "--questions", str(questions), "--max-new-tokens",
                    str(max_new_tokens), "--methods", ",".join(methods), "--busy", f"{busy:.3f}", "--json", str(out)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["summary"]
    return {method: summary[method]["tokens_per_s"] for method in methods}


def measure(prompt: str, max_new_tokens: int, pairs: int, folder: Path) -> list[dict[str, dict[str, float]]]:
    """For each pair, by method: the page's tokens/s and browser cores, the bench's tokens/s quiet and beside a load
    of those cores. The app waits idle while the bench runs."""
    process, url = start_app("--max-new-tokens", str(max_new_tokens), log=folder / "app.log")
    try:
        with sync_playwright() as playwright:
            rows = []
            for _ in range(pairs):
                page = page_speeds(playwright, url, prompt, max_new_tokens)
                quiet = bench_speeds(prompt, max_new_tokens, folder, list(METHODS))
                rows.append({method: {"page": tps, "browser": share, "bench": quiet[method],
                                      "loaded": bench_speeds(prompt, max_new_tokens, folder, [method], share)[method]}
                             for method, (tps, share) in page.items()})
            return rows
    finally:
        stop_app(process)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.page_vs_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=3, help="plain and EAGLE answers taken in turn, this many each")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    rows = measure(args.prompt, args.max_new_tokens, args.pairs, Path(tempfile.mkdtemp()))
    print("tok/s, the mean over the pairs; the bench quiet, and beside a load of the cores the browser used")
    print(f"{'method':11} {'page':>7} {'bench':>7} {'page/bench':>10} {'browser':>8} {'bench+load':>10} "
          f"{'page/(bench+load)':>17}")
    for method in METHODS:
        page, bench, share, loaded = (mean(row[method][key] for row in rows)
                                      for key in ("page", "bench", "browser", "loaded"))
        print(f"{method:11} {page:7.1f} {bench:7.1f} {page / bench:10.0%} {share:8.2f} {loaded:10.1f} "
              f"{page / loaded:17.0%}")
    for i, row in enumerate(rows, 1):
        print(f"pair {i}: " + "  ".join(f"{method} {r['page']:.1f} / {r['bench']:.1f} / {r['loaded']:.1f} "
                                       f"({r['browser']:.2f} core)" for method, r in row.items()))


if __name__ == "__main__":
    main()
