"""The chat store on real files: chats survive a restart, one owner never reaches another's, exports import back,
and a file the store cannot use (damaged, foreign, read-only, a folder, a full disk, a killed writer) is left as it
was while the chats go on in memory."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from app.store import ChatStore, StoredChat, chat_json, chat_markdown, parse_chat_json, title_of

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"method": "eagle", "model": "smollm2", "head": "smollm2-135m-eagle3", "tokens": 120, "tokens_per_s": 150.2,
           "tau": 1.8, "accepted": 50, "drafted": 90, "speedup": 1.12, "ttft_s": 0.11, "finish": "eos"}
ANSWER = {"ids": [9906, 1917], "pieces": ["Hello", " world"], "drafted": [False, True], "from_context": [False, False]}


def user(text: str, in_context: bool = True) -> dict:
    return {"role": "user", "text": text, "in_context": in_context, "note": "", "figures": None, "answer": None}


def reply(text: str, figures: dict | None = None, note: str = "", answer: dict | None = None) -> dict:
    return {"role": "assistant", "text": text, "in_context": True, "note": note, "figures": figures, "answer": answer}


def notice(text: str) -> dict:
    return {"role": "assistant", "text": text, "in_context": False, "note": "", "figures": None, "answer": None}


CHAT = [user("What is speculative decoding?\nIn short."), reply("A draft model guesses, the base model checks.",
        FIGURES, "Stopped after 40 tokens.", ANSWER), user("And τ?"), notice("The model is busy: try again.")]


def files_under(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder under `folder`: what a store must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def a_database_with_one_chat(path: Path) -> str:
    """A database written and closed, as a previous run leaves it."""
    store = ChatStore(path)
    chat_id = store.create("alice")
    store.save(chat_id, "alice", CHAT)
    store.close()
    return chat_id


def run_python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def test_chats_survive_a_restart_in_a_folder_created_for_them(tmp_path):
    path = tmp_path / "data" / "chats" / "chats.sqlite3"
    store = ChatStore(path)
    chat_id = store.create("alice")
    store.save(chat_id, "alice", CHAT)
    assert store.problem is None and path.parent.is_dir()

    again = ChatStore(path)
    assert again.problem is None and again.path == path
    summaries = [(c.id, c.title, c.messages) for c in again.chats("alice")]
    assert summaries == [(chat_id, "What is speculative decoding?", 4)]
    chat = again.load(chat_id, "alice")
    assert chat.messages == CHAT and chat.title == "What is speculative decoding?"
    assert chat.created <= chat.updated


def test_memory_by_choice_is_no_problem():
    store = ChatStore(None)
    chat_id = store.create("local")
    store.save(chat_id, "local", CHAT[:2])
    assert store.path is None and store.problem is None and store.load(chat_id, "local").messages == CHAT[:2]


def test_newest_first_and_a_save_replaces_the_messages(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    first, second = store.create("alice"), store.create("alice")
    store.save(first, "alice", [user("one")])
    store.save(second, "alice", [user("two")])
    assert [c.id for c in store.chats("alice")] == [second, first]
    store.save(first, "alice", [user("one"), reply("1")])
    assert [(c.id, c.messages) for c in store.chats("alice")] == [(first, 2), (second, 1)]
    store.save(first, "alice", [user("one, shorter")])
    assert store.load(first, "alice").messages == [user("one, shorter")]


def test_titles():
    assert title_of([]) == "New chat"
    assert title_of([notice("an error"), user("  \n\n   Tell me   about\tsquid  \nmore")]) == "Tell me about squid"
    long = title_of([user("word " * 40)])
    assert len(long) == 60 and long.endswith("…")


def test_a_new_chat_is_named_after_its_first_message_once(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat_id = store.create("alice")
    store.save(chat_id, "alice", [])
    assert store.load(chat_id, "alice").title == "New chat"
    store.save(chat_id, "alice", [user("Squid facts")])
    store.save(chat_id, "alice", [user("Octopus facts")])
    assert store.load(chat_id, "alice").title == "Squid facts"
    store.save(chat_id, "alice", [user("Octopus facts")], title="  Cephalopods ")
    assert store.load(chat_id, "alice").title == "Cephalopods"
    store.save("made-by-save", "alice", [user("Unseen id")])
    assert store.load("made-by-save", "alice").title == "Unseen id"


def test_rename_and_delete(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat_id = store.create("alice")
    store.rename(chat_id, "alice", "  Squid\n facts  ")
    assert store.load(chat_id, "alice").title == "Squid facts"
    store.rename(chat_id, "alice", "x" * 500)
    assert len(store.load(chat_id, "alice").title) == 200
    with pytest.raises(ValueError, match="empty"):
        store.rename(chat_id, "alice", " \n ")
    store.delete(chat_id, "alice")
    assert store.chats("alice") == []
    with pytest.raises(KeyError):
        store.load(chat_id, "alice")
    with pytest.raises(KeyError):
        store.rename(chat_id, "alice", "gone")
    store.delete(chat_id, "alice")


def test_an_owner_never_reaches_another_owners_chat(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat_id = store.create("alice")
    store.save(chat_id, "alice", CHAT)
    bob_id = store.create("bob")
    assert [c.id for c in store.chats("bob")] == [bob_id]
    with pytest.raises(KeyError) as load_error:
        store.load(chat_id, "bob")
    with pytest.raises(KeyError) as missing_error:
        store.load("no-such-chat", "bob")
    assert str(load_error.value).replace(chat_id, "?") == str(missing_error.value).replace("no-such-chat", "?")
    with pytest.raises(KeyError):
        store.rename(chat_id, "bob", "mine now")
    with pytest.raises(KeyError):
        store.save(chat_id, "bob", [user("overwritten")])
    store.delete(chat_id, "bob")
    chat = store.load(chat_id, "alice")
    assert chat.messages == CHAT and chat.title == "What is speculative decoding?"
    assert [c.id for c in store.chats("alice")] == [chat_id]


def test_the_json_export_imports_back_whole(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat_id = store.create("alice")
    store.save(chat_id, "alice", CHAT, title="Squid ✓")
    exported = chat_json(store.load(chat_id, "alice"))
    data = json.loads(exported)
    assert (data["format"], data["version"], data["title"]) == ("eagle-chat", 1, "Squid ✓") and "✓" in exported

    copy_id = store.import_chat("bob", exported.encode())
    copy = store.load(copy_id, "bob")
    assert copy_id != chat_id and copy.title == "Squid ✓" and copy.messages == CHAT
    assert copy.messages[1]["answer"] == ANSWER and copy.messages[1]["figures"] == FIGURES
    assert parse_chat_json(exported) == ("Squid ✓", CHAT)


def test_an_import_fills_in_optional_fields_and_names_an_untitled_chat():
    title, messages = parse_chat_json(json.dumps(
        {"format": "eagle-chat", "version": 1, "messages": [{"role": "user", "text": "Hi there", "extra": 1}]}))
    assert title == "Hi there" and messages == [user("Hi there")]


def export(**changes) -> str:
    data = {"format": "eagle-chat", "version": 1, "title": "t", "messages": [user("a"), reply("b")]}
    return json.dumps({**data, **changes})


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not JSON"),
    (b"\xff\xfe\xfa", "not JSON"),
    ("[1, 2]", "is a list, not an object"),
    (export(format="other-app"), "format is 'other-app'"),
    (json.dumps({"version": 1, "messages": []}), "format is None"),
    (export(version=2), "unsupported chat export version 2"),
    (export(messages=None), "no list of messages"),
    (export(messages={"0": user("a")}), "no list of messages"),
    (export(messages=[user("a"), "b"]), "message 2 is a string"),
    (export(messages=[user("a"), {**reply("b"), "role": "system"}]), "message 2 has role 'system'"),
    (export(messages=[{"role": "user"}]), "message 1 has no text string"),
    (export(messages=[user("a"), reply("b"), {**user("c"), "text": 3}]), "message 3 has no text string"),
    (export(messages=[{**reply("b"), "figures": [1]}]), "message 1 has figures a list"),
    (export(messages=[{**reply("b"), "in_context": "yes"}]), "message 1 has in_context a string"),
])
def test_a_bad_export_is_refused_with_its_reason(tmp_path, text, reason):
    with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
        parse_chat_json(text)
    store = ChatStore(tmp_path / "chats.sqlite3")
    with pytest.raises(ValueError):
        store.import_chat("alice", text)
    assert store.chats("alice") == []


def test_markdown_shows_the_messages_figures_and_notices():
    chat = StoredChat("id", "Squid", 1_700_000_000.0, 1_700_000_100.0, CHAT + [
        reply("```python\nprint('cut off", {"method": "suffix", "tokens": 3, "speed": "fast", "tau": None})])
    text = chat_markdown(chat)
    assert text.startswith("# Squid\n")
    assert "**You**\n\nWhat is speculative decoding?\nIn short.\n\n**Assistant**\n\n" in text
    assert ("*EAGLE · smollm2 + smollm2-135m-eagle3 · 120 tokens · 150.2 tokens/s · τ 1.80 · 50 of 90 drafted "
            "tokens accepted · 1.12× plain decoding · first token 0.11 s · finished*") in text
    assert "*Stopped after 40 tokens.*" in text
    assert "> The model is busy: try again." in text
    assert "*Context drafting (no head) · 3 tokens · speed: fast*" in text
    assert "print('cut off\n```" in text
    assert "9906" not in text and "pieces" not in text


def test_the_store_is_safe_from_several_threads(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    ids = [store.create(f"user{n}") for n in range(4)]
    errors = []

    def write(n: int) -> None:
        try:
            for i in range(10):
                store.save(ids[n], f"user{n}", [user(f"{n}"), reply(str(i))])
                store.chats(f"user{n}")
        except Exception as error:  # the assertion below shows it
            errors.append(error)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and store.problem is None
    assert [ChatStore(store.path).load(ids[n], f"user{n}").messages[1]["text"] for n in range(4)] == ["9"] * 4


def garbage(tmp_path: Path) -> Path:
    path = tmp_path / "chats.sqlite3"
    path.write_bytes(bytes(range(256)) * 16)
    return path


def overwritten_header(tmp_path: Path) -> Path:
    path = tmp_path / "chats.sqlite3"
    a_database_with_one_chat(path)
    with open(path, "r+b") as file:
        file.write(b"this header is not SQLite's any more, nor are the next bytes of it" * 2)
    return path


def a_folder(tmp_path: Path) -> Path:
    path = tmp_path / "chats.sqlite3"
    path.mkdir()
    (path / "keep.txt").write_text("mine")
    return path


def under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("a file where the folder should be")
    return tmp_path / "notes.txt" / "chats.sqlite3"


def another_programs_database(tmp_path: Path) -> Path:
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
        db.execute("INSERT INTO notes VALUES ('mine')")
    db.close()
    return path


def a_newer_apps_database(tmp_path: Path) -> Path:
    path = tmp_path / "chats.sqlite3"
    a_database_with_one_chat(path)
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 7")
    db.close()
    return path


def works_in_memory(store: ChatStore) -> None:
    chat_id = store.create("alice")
    store.save(chat_id, "alice", CHAT)
    assert chat_id in [c.id for c in store.chats("alice")] and store.load(chat_id, "alice").messages == CHAT


@pytest.mark.parametrize("make, reason", [
    (garbage, "is not a SQLite database (file is not a database)"),
    (overwritten_header, "is not a SQLite database (file is not a database)"),
    (a_folder, "is a folder, not a file"),
    (under_a_file, "cannot be created"),
    (another_programs_database, "is another program's database (tables: notes)"),
    (a_newer_apps_database, "was written by a newer version of this app (chats schema 7, this one reads 1)"),
])
def test_a_file_the_store_cannot_use_is_left_as_it_was(tmp_path, make, reason):
    path = make(tmp_path)
    before = files_under(tmp_path)
    store = ChatStore(path)
    assert store.problem.startswith(f"Chats are not being saved: {path} {reason}")
    assert "until the app stops" in store.problem
    works_in_memory(store)
    assert files_under(tmp_path) == before


def in_a_child(work: Callable[[], object], uid: int | None) -> object:
    """work()'s JSON-able result, computed in a forked child running as user `uid`: a process whose user the test
    can change without changing its own."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            if uid is not None:
                os.setuid(uid)
            os.write(write, json.dumps(work()).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        output = pipe.read()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the child failed: see its traceback above"
    return json.loads(output)


@pytest.fixture
def open_folder():
    """A folder that other users can reach (tmp_path's parents are closed to them)."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        yield Path(folder)


def test_a_read_only_database_shows_its_chats_and_is_left_as_it_was(open_folder):
    """Read-only for real even when the tests run as root, whom chmod does not stop: then the child opens the file
    as nobody."""
    folder = open_folder / "data"
    path = folder / "chats.sqlite3"
    chat_id = a_database_with_one_chat(path)
    path.chmod(0o444)
    folder.chmod(0o555)
    before = files_under(open_folder)

    def open_read_only() -> dict:
        store = ChatStore(path)
        old = [c.id for c in store.chats("alice")]
        messages = store.load(chat_id, "alice").messages
        works_in_memory(store)
        return {"problem": store.problem, "old": old, "messages": messages}

    try:
        seen = in_a_child(open_read_only, uid=65534 if os.geteuid() == 0 else None)
    finally:
        folder.chmod(0o755)
    assert seen["problem"].startswith(f"Chats are not being saved: {path} is read-only (attempt to write a readonly "
                                      "database)")
    assert seen["old"] == [chat_id] and seen["messages"] == CHAT
    assert files_under(open_folder) == before


FULL_DISK = """
import json, resource, signal, sys
from app.store import ChatStore
store = ChatStore(sys.argv[1])
kept = store.create("alice")
store.save(kept, "alice", [{"role": "user", "text": "kept"}])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
big = store.create("alice")
store.save(big, "alice", [{"role": "user", "text": "x" * 1_000_000}])
print(json.dumps({"problem": store.problem, "kept": kept, "chats": [c.id for c in store.chats("alice")],
                  "big": len(store.load(big, "alice").messages[0]["text"])}))
"""


def test_a_write_that_fails_moves_the_chats_to_memory(tmp_path):
    """A full disk for real: the child may not grow any file (RLIMIT_FSIZE binds root too)."""
    path = tmp_path / "chats.sqlite3"
    child = run_python(FULL_DISK, str(path))
    seen = json.loads(child.communicate(timeout=30)[0])
    assert child.returncode == 0
    assert seen["problem"].startswith(f"Chats are not being saved: {path} ")
    assert seen["problem"].endswith("so changes from now on last only until the app stops.")
    assert seen["big"] == 1_000_000 and len(seen["chats"]) == 2 and seen["kept"] in seen["chats"]

    after = ChatStore(path)
    assert after.problem is None
    assert [c.id for c in after.chats("alice")] == [seen["kept"]]
    assert after.load(seen["kept"], "alice").messages == [{"role": "user", "text": "kept"}]


SAVING_FOREVER = """
import itertools, sys
from pathlib import Path
from app.store import ChatStore
store = ChatStore(sys.argv[1])
for version in itertools.count():
    store.save("chat", "alice", [{"role": "user", "text": f"{version} {i} " + "x" * 20_000} for i in range(20)])
    if version == 5:
        Path(sys.argv[2]).touch()
"""


def test_a_process_killed_while_saving_leaves_its_last_save(tmp_path):
    path, ready = tmp_path / "chats.sqlite3", tmp_path / "ready"
    child = run_python(SAVING_FOREVER, str(path), str(ready))
    deadline = time.monotonic() + 20
    while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.15)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL and ready.exists()

    store = ChatStore(path)
    assert store.problem is None
    texts = [m["text"] for m in store.load("chat", "alice").messages]
    version = int(texts[0].split()[0])
    assert version >= 5 and texts == [f"{version} {i} " + "x" * 20_000 for i in range(20)]
