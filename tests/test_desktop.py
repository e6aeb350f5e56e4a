"""The desktop parts of the real app in headless Chromium: chats kept on disk across a restart, reopened and continued;
each answer's figures under it and in the exports; models loaded from the Models tab without a restart; users with
--auth kept apart; a damaged chat database that costs nothing but saving."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api", reason="pip install -r requirements-dev.txt")
from app.browser import (  # noqa: E402
    CHROMIUM, last_answer_text, open_app, send, set_number, start_app, stop_app, wait_for_answer,
)

from engine import DecodeParams, Engine  # noqa: E402
from engine.draft.checkpoint import save_head  # noqa: E402
from engine.model.load import embedded_gguf_path  # noqa: E402
from engine.testing.tiny import random_head, tiny_base  # noqa: E402

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing: apt-get install chromium")
SHORT = 12  # tokens per answer
FIRST = "Name three colours."


def start(tmp: Path, *args: str, data: Path | None = None, models: Path | None = None):
    """The app on its own data and models folders (never the user's), answers SHORT tokens long."""
    data, models = data or tmp / "data", models or tmp / "models"
    models.mkdir(parents=True, exist_ok=True)
    return start_app("--max-new-tokens", str(SHORT), "--data-dir", str(data), "--models-dir", str(models), *args,
                     log=tmp / f"app-{len(list(tmp.glob('app-*.log')))}.log")


def history(page) -> list[str]:
    return [t.strip() for t in page.locator("#history label").all_inner_texts()]


def answer(page, text: str) -> None:
    wait_for_answer(page, send(page, text), timeout_s=120)


def download(page, button: str) -> str:
    with page.expect_download(timeout=30_000) as event:
        page.click(f"{button}")
    return Path(event.value.path()).read_text(encoding="utf-8")


def test_a_chat_survives_a_restart_reopens_from_the_list_and_continues(browser, tmp_path):
    process, url = start(tmp_path)
    try:
        page = open_app(browser, url)
        answer(page, FIRST)
        first_answer = last_answer_text(page)
        page.wait_for_function("() => document.querySelectorAll('#history label').length === 1", timeout=30_000)
        assert history(page) == [FIRST]
        figures = page.locator("#chat details.reply-figures").last
        assert "tokens/s" in figures.inner_text()  # the line shown while collapsed
        assert "τ" in figures.text_content() and "drafted tokens accepted" in figures.text_content()
        page.click("#chat-actions")  # the accordion with the chat's actions
        markdown = download(page, "#export")
        assert f"# {FIRST}" in markdown
        assert "tokens/s" in markdown and "τ" in markdown and "drafted tokens accepted" in markdown
        exported = json.loads(download(page, "#export-json"))
        reply = exported["messages"][1]
        assert reply["role"] == "assistant" and reply["figures"]["tokens_per_s"] > 0
        assert reply["figures"]["model"] == "smollm2" and reply["figures"]["drafted"] >= reply["figures"]["accepted"]
        page.context.close()
    finally:
        stop_app(process)

    process, url = start(tmp_path, data=tmp_path / "data")  # the same data folder, a new process
    try:
        page = open_app(browser, url)
        page.wait_for_function("() => document.querySelectorAll('#history label').length === 1", timeout=30_000)
        page.locator("#history label").first.click()
        page.wait_for_function("() => document.querySelectorAll('#chat div.eagle-answer').length === 1",
                               timeout=30_000)
        assert last_answer_text(page) == first_answer
        assert page.locator("#chat details.reply-figures").count() == 1
        answer(page, "And three animals?")
        assert page.locator("#chat div.eagle-user").count() == 2 and page.locator("#chat div.eagle-answer").count() == 2
        page.wait_for_function("() => document.querySelectorAll('#history label').length === 1", timeout=30_000)

        imported = tmp_path / "chat.json"
        imported.write_text(json.dumps(exported), encoding="utf-8")
        page.click("#new-chat")
        page.wait_for_function("() => document.querySelectorAll('#chat div.eagle-msg').length === 0", timeout=30_000)
        page.click("#chat-actions")
        with page.expect_file_chooser(timeout=30_000) as chooser:
            page.click("#import")
        chooser.value.set_files(str(imported))
        page.wait_for_function("() => document.querySelectorAll('#history label').length === 2", timeout=30_000)
        page.wait_for_function("() => document.querySelectorAll('#chat div.eagle-answer').length === 1",
                               timeout=30_000)
        assert last_answer_text(page) == first_answer
        page.context.close()
    finally:
        stop_app(process)


def test_a_gguf_typed_in_loads_without_a_restart_and_a_head_for_another_model_is_refused(browser, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    copy = models / "smollm2-copy.gguf"
    shutil.copyfile(embedded_gguf_path(), copy)
    save_head(random_head(tiny_base("llama-h64-l8-gqa"), "eagle3"), models / "tiny-eagle3")
    (tmp_path / "notes.gguf").write_text("not a model")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(copy.read_bytes()[: copy.stat().st_size - 7])
    process, url = start(tmp_path, "--head", "none", models=models)
    try:
        page = open_app(browser, url)
        page.get_by_role("tab", name="Models").click()
        assert "smollm2-copy.gguf" in page.locator("#models").inner_text()

        for bad, reason in ((tmp_path / "notes.gguf", "GGUF"), (truncated, "truncated")):
            page.fill("#model-path textarea, #model-path input", str(bad))
            page.click("#load-model")
            page.wait_for_function(
                "r => { const s = document.querySelector('#model-status .model-status');"
                " return s && s.dataset.state === 'refused' && s.textContent.includes(r); }", arg=reason,
                timeout=30_000)

        page.fill("#model-path textarea, #model-path input", str(copy))
        page.press("#model-path textarea, #model-path input", "Enter")
        page.wait_for_selector("#model-info .model-info[data-state=ok]", timeout=60_000)
        page.click("#head-choice input")
        page.locator("#head-choice li[role=option]", has_text="does not fit").first.click()
        page.click("#load-model")
        page.wait_for_function(
            "() => { const s = document.querySelector('#model-status .model-status');"
            " return s && s.dataset.state === 'refused' && s.textContent.includes('hidden_size'); }", timeout=60_000)
        assert page.locator("#model-status .model-status").get_attribute("data-base") == "smollm2"
        page.get_by_role("tab", name="Chat").click()
        answer(page, FIRST)  # the old model keeps answering
        assert last_answer_text(page)

        page.get_by_role("tab", name="Models").click()
        page.click("#head-choice input")
        page.locator("#head-choice li[role=option]", has_text="none").first.click()
        page.click("#load-model")
        page.wait_for_function(
            "() => { const s = document.querySelector('#model-status .model-status');"
            " return s && s.dataset.state === 'loaded' && s.dataset.base === 'smollm2-copy.gguf'; }", timeout=120_000)
        assert "smollm2-copy.gguf" in page.locator("#engine-description").inner_text()
        page.get_by_role("tab", name="Chat").click()
        page.click("#new-chat")
        page.wait_for_function("() => document.querySelectorAll('#chat div.eagle-msg').length === 0", timeout=30_000)
        set_number(page, "max-new-tokens", SHORT)
        answer(page, "What is the capital of France?")
        shown = last_answer_text(page)
        page.context.close()
    finally:
        stop_app(process)
    engine = Engine.load(str(copy), head="none")  # what `python app.py --base THAT.gguf` answers
    want = engine.chat_text([{"role": "user", "content": "What is the capital of France?"}],
                            DecodeParams(method="vanilla", max_new_tokens=SHORT))
    assert shown.strip() == want.strip()


def login(browser, url: str, user: str, password: str):
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.goto(url)
    page.fill("input[type=text]", user)
    page.fill("input[type=password]", password)
    page.keyboard.press("Enter")
    page.wait_for_selector("#prompt textarea", timeout=60_000)
    return page


def test_signed_in_users_see_only_their_own_chats(browser, tmp_path):
    process, url = start(tmp_path, "--auth", "ann:secret-a", "--auth", "bob:secret-b")
    try:
        ann = login(browser, url, "ann", "secret-a")
        answer(ann, FIRST)
        ann.wait_for_function("() => document.querySelectorAll('#history label').length === 1", timeout=30_000)
        bob = login(browser, url, "bob", "secret-b")
        answer(bob, "Name three animals.")
        bob.wait_for_function("() => document.querySelectorAll('#history label').length === 1", timeout=30_000)
        assert "colours" not in " ".join(history(bob)) and "animals" not in " ".join(history(ann))
        ann.reload()
        ann.wait_for_selector("#prompt textarea", timeout=60_000)
        ann.wait_for_function("() => document.querySelectorAll('#history label').length === 1", timeout=30_000)
        assert "colours" in " ".join(history(ann))
    finally:
        stop_app(process)


def test_a_damaged_chat_database_is_left_alone_and_the_app_still_chats(browser, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    damaged = data / "chats.sqlite3"
    damaged.write_bytes(b"\x13garbage" * 512)
    process, url = start(tmp_path, data=data)
    try:
        page = open_app(browser, url)
        notice = page.wait_for_selector("#store-status .store-problem", timeout=30_000)
        assert "not being saved" in notice.inner_text()
        answer(page, FIRST)
        assert last_answer_text(page)
        page.wait_for_function("() => document.querySelectorAll('#history label').length === 1", timeout=30_000)
    finally:
        stop_app(process)
    assert damaged.read_bytes() == b"\x13garbage" * 512
