"""Drive the real app in headless Chromium: start `python app.py`, open it, chat. Used by the browser test and the
scripts that measure or picture the page (`python -m scripts.screenshot`, `python -m scripts.page_vs_bench`).

The browser is Debian's Chromium (`apt-get install chromium`) driven by the `playwright` package; playwright's
own browser download is never used.
"""
from __future__ import annotations

from playwright.sync_api import Browser, Page, Playwright

from .process import ROOT, start_app, stop_app  # noqa: F401  (the browser test and the scripts start it)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]


def launch_chromium(playwright: Playwright) -> Browser:
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def open_app(browser: Browser, url: str, width: int = 1280, height: int = 900) -> Page:
    """A fresh page (its own Gradio session) with the app loaded."""
    page = browser.new_context(viewport={"width": width, "height": height}).new_page()
    page.goto(url)
    page.wait_for_selector("#prompt textarea", timeout=60_000)
    return page


def set_number(page: Page, elem_id: str, value: float) -> None:
    """Type a value into a slider's number box, as a user would."""
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def choose_method(page: Page, label: str) -> None:
    page.get_by_label(label, exact=True).check()


def send(page: Page, text: str) -> int:
    """Send a chat message; returns how many answers the chat showed before it."""
    answers = page.locator("#chat div.eagle-answer").count()
    page.fill("#prompt textarea", text)
    page.press("#prompt textarea", "Enter")
    return answers


def meter(page: Page) -> dict[str, str]:
    """The meter's figures, from its data- attributes."""
    return page.eval_on_selector(
        "#meter .meter", "m => Object.fromEntries(Object.entries(m.dataset))"
    )


# Playwright polls on every animation frame by default, running script in the page 60 times a second: on a machine
# with few cores that takes a share of a core from the decoder, which a user's browser does not.
POLL_MS = 200
_ANSWERED = """n => document.querySelectorAll('#chat div.eagle-answer').length > n
    && document.querySelector('#meter .meter').dataset.state === 'idle'"""


def answered(page: Page, answers_before: int) -> bool:
    """A new answer is in the chat and the meter says decoding is over (read in one go: the two change together)."""
    return page.evaluate(_ANSWERED, answers_before)


def wait_for_answer(page: Page, answers_before: int, timeout_s: float = 120) -> None:
    page.wait_for_function(_ANSWERED, arg=answers_before, timeout=timeout_s * 1000, polling=POLL_MS)


def clear_chat(page: Page) -> None:
    page.click("#clear")
    page.wait_for_function("() => document.querySelectorAll('#chat div.eagle-msg').length === 0", timeout=30_000)


def answer_afresh(page: Page, method_label: str, prompt: str, timeout_s: float = 300) -> dict[str, str]:
    """Clear the chat, answer `prompt` with the method labelled `method_label`; returns the meter's figures."""
    clear_chat(page)
    choose_method(page, method_label)
    wait_for_answer(page, send(page, prompt), timeout_s=timeout_s)
    return meter(page)


def last_answer_text(page: Page) -> str:
    return page.locator("#chat div.eagle-answer").last.inner_text()
