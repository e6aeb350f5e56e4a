"""Take the README screenshot from the real app: start `python app.py` on a fresh data folder, keep a first chat,
answer a question in a second one, open its figures, capture the page.

    python -m scripts.screenshot [--out assets/screenshot.png] [--max-new-tokens 96] [-- app.py options]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from app.browser import ROOT, launch_chromium, open_app, send, set_number, start_app, stop_app, wait_for_answer

PROMPT = "Explain what a hash table is, with a small Python example."
FIRST_CHAT = "Name the three primary colours."
MAX_BYTES = 300_000


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.screenshot", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "screenshot.png")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("app_args", nargs="*", help="extra app.py options, after --")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    process, url = start_app("--data-dir", str(folder), *args.app_args, log=folder / "app.log")
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page = open_app(browser, url, width=1280, height=860)
            set_number(page, "max-new-tokens", 24)
            wait_for_answer(page, send(page, FIRST_CHAT), timeout_s=600)
            page.click("#new-chat")
            page.wait_for_function("() => !document.querySelector('#chat div.eagle-msg')")
            set_number(page, "max-new-tokens", args.max_new_tokens)
            wait_for_answer(page, send(page, args.prompt), timeout_s=600)
            page.wait_for_function("() => document.querySelectorAll('#history label').length === 2")
            page.locator("#chat details.reply-figures summary").last.click()
            page.evaluate("window.scrollTo(0, 0)")
            page.wait_for_selector("#engine-status .engine-status[data-active='0']")  # refreshed every second
            page.mouse.move(0, 0)  # no hover effects in the picture
            page.screenshot(path=str(args.out))
            browser.close()
    finally:
        stop_app(process)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1000:.0f} kB)")
    if size > MAX_BYTES:
        raise SystemExit(f"{args.out} is over {MAX_BYTES / 1000:.0f} kB: use a smaller window or fewer tokens")


if __name__ == "__main__":
    main()
