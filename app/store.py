"""Chats that survive a restart: each owner's conversations in one SQLite file, and one chat as Markdown or JSON.

A save replaces a chat's messages in one transaction on a WAL database synced in full, so a crash or a killed
process leaves the last completed save. A file the store cannot use (not a database, another program's, read-only,
a folder, a full disk) is never changed or deleted: the store moves to an in-memory database holding what it could
still read, keeps working for this process, and says why in `problem`. No Gradio and no engine here.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .figures import figures_line
from urllib.parse import quote

T = TypeVar("T")

SCHEMA_VERSION = 1  # PRAGMA user_version of a database this module wrote
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS chats (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        title TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        size INTEGER NOT NULL,
        messages TEXT NOT NULL
    )""",  # size: the messages, counted; messages: a JSON list, the last column so that listing never reads it
    "CREATE INDEX IF NOT EXISTS chats_of_owner ON chats (owner, updated)",
    f"PRAGMA user_version = {SCHEMA_VERSION}",
)
NEW_CHAT = "New chat"
TITLE_CHARS = 60  # a title made from the first message
MAX_TITLE_CHARS = 200  # a title the user typed
EXPORT_FORMAT, EXPORT_VERSION = "eagle-chat", 1
ROLES = ("user", "assistant")
MESSAGE_FIELDS = {"in_context": (bool, True), "note": (str, ""), "figures": (dict, None), "answer": (dict, None)}
SPEAKERS = {"user": "**You**", "assistant": "**Assistant**"}
SQLITE_REASONS = {
    sqlite3.SQLITE_NOTADB: "is not a SQLite database",
    sqlite3.SQLITE_CORRUPT: "is damaged",
    sqlite3.SQLITE_READONLY: "is read-only",
    sqlite3.SQLITE_CANTOPEN: "cannot be opened",
    sqlite3.SQLITE_PERM: "cannot be opened",
    sqlite3.SQLITE_FULL: "cannot grow: the disk is full",
    sqlite3.SQLITE_IOERR: "cannot be read or written",
}


@dataclass(frozen=True)
class ChatSummary:
    id: str
    title: str
    created: float
    updated: float
    messages: int


@dataclass
class StoredChat:
    id: str
    title: str
    created: float
    updated: float
    messages: list[dict]


class _Unusable(Exception):
    """A database file the store must leave alone; the message says why, following the file's path."""


class ChatStore:
    """Every owner's chats; each owner sees, loads, renames and deletes only their own. Safe to call from several
    threads (Gradio runs handlers on worker threads): one connection, every use under one lock."""

    def __init__(self, path: str | Path | None):
        """`path` None keeps chats in memory by choice (`problem` stays None)."""
        self.path = None if path is None else Path(path)
        self.problem: str | None = None  # why chats are not being saved to disk, for the user; None while they are
        self._lock = threading.Lock()
        self._db = _in_memory() if self.path is None else self._open(self.path)

    def _open(self, path: Path) -> sqlite3.Connection:
        try:
            return _open_file(path)
        except (OSError, sqlite3.Error, _Unusable) as error:
            left = "; it was left as it was" if path.exists() else ""
            self.problem = (f"Chats are not being saved: {path} {_reason(path, error)}, so chats last only until "
                            f"the app stops{left}.")
            return _rescued(path)

    @property
    def _on_disk(self) -> bool:
        return self.path is not None and self.problem is None

    def _use(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run `work` under the lock; if the file fails it, move to memory with what could be read, and run it
        there: a disk that fills up or goes away costs the saving, never the chat."""
        with self._lock:
            try:
                return work(self._db)
            except sqlite3.Error as error:
                if not self._on_disk:
                    raise
                self.problem = (f"Chats are not being saved: {self.path} {_reason(self.path, error)}, so changes "
                                f"from now on last only until the app stops.")
                failed, self._db = self._db, _in_memory(self._db)
                with suppress(sqlite3.Error):
                    failed.close()
                return work(self._db)

    def create(self, owner: str, title: str = NEW_CHAT) -> str:
        chat_id, title, now = uuid.uuid4().hex, _clean_title(title), time.time()
        self._use(lambda db: db.execute("INSERT INTO chats VALUES (?, ?, ?, ?, ?, 0, '[]')",
                                        (chat_id, owner, title, now, now)))
        return chat_id

    def save(self, chat_id: str, owner: str, messages: list[dict], title: str | None = None) -> None:
        """Replace the chat's messages, all or nothing, creating the chat if it is new. `title` None keeps the
        title, except that a chat still called "New chat" is named after its first message. KeyError for a chat
        of another owner."""
        body = json.dumps(messages, ensure_ascii=False)
        title = None if title is None else _clean_title(title)
        self._use(lambda db: _save(db, chat_id, owner, messages, body, title))

    def chats(self, owner: str) -> list[ChatSummary]:
        """The owner's chats, the last one written to first."""
        rows = self._use(lambda db: db.execute(
            "SELECT id, title, created, updated, size FROM chats WHERE owner = ? ORDER BY updated DESC, created DESC",
            (owner,)).fetchall())
        return [ChatSummary(*row) for row in rows]

    def load(self, chat_id: str, owner: str) -> StoredChat:
        row = self._use(lambda db: db.execute(
            "SELECT id, title, created, updated, messages FROM chats WHERE id = ? AND owner = ?",
            (chat_id, owner)).fetchone())
        if row is None:
            raise KeyError(_missing(chat_id))
        return StoredChat(*row[:4], json.loads(row[4]))

    def rename(self, chat_id: str, owner: str, title: str) -> None:
        title = _clean_title(title)
        changed = self._use(lambda db: db.execute(
            "UPDATE chats SET title = ? WHERE id = ? AND owner = ?", (title, chat_id, owner)).rowcount)
        if not changed:
            raise KeyError(_missing(chat_id))

    def delete(self, chat_id: str, owner: str) -> None:
        """Deleting a chat that is gone already does nothing (a second click, a second tab)."""
        self._use(lambda db: db.execute("DELETE FROM chats WHERE id = ? AND owner = ?", (chat_id, owner)))

    def close(self) -> None:
        """Let go of the file now (checkpointed, its -wal and -shm removed): Python frees a sqlite3 connection only
        when it collects cycles. The store is not used after."""
        with self._lock:
            self._db.close()

    def import_chat(self, owner: str, exported: str | bytes) -> str:
        """Store a JSON export (chat_json) as a new chat of `owner`; ValueError saying what is wrong with it."""
        title, messages = parse_chat_json(exported)
        chat_id = uuid.uuid4().hex
        self.save(chat_id, owner, messages, title)
        return chat_id


def _connect(target: str, uri: bool = False) -> sqlite3.Connection:
    """Autocommit (transactions are explicit), usable from any thread (the store's lock serializes)."""
    return sqlite3.connect(target, uri=uri, isolation_level=None, check_same_thread=False)


def _open_file(path: Path) -> sqlite3.Connection:
    """The database at `path`, checked to be empty or this module's before anything is written to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = _connect(str(path))
    try:
        _check_ours(db)
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        _create_schema(db)
    except BaseException:
        db.close()
        raise
    return db


def _check_ours(db: sqlite3.Connection) -> None:
    """Reads only: a file that is not a database fails here, and another program's database is left alone."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    tables = sorted(name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    if version > SCHEMA_VERSION:
        raise _Unusable(f"was written by a newer version of this app (chats schema {version}, this one reads "
                        f"{SCHEMA_VERSION})")
    if tables and (version != SCHEMA_VERSION or "chats" not in tables):
        raise _Unusable(f"is another program's database (tables: {', '.join(tables)})")


def _create_schema(db: sqlite3.Connection) -> None:
    with _transaction(db):
        for statement in SCHEMA:
            db.execute(statement)


def _rescued(path: Path) -> sqlite3.Connection:
    """A memory copy of the chats the file still holds, read as immutable (no lock or WAL index, which a read-only
    folder could not hold); an empty memory database where it holds none that can be read."""
    try:
        source = _connect(f"file:{quote(str(path))}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error:
        return _in_memory()
    try:
        return _in_memory(source)
    finally:
        source.close()


def _in_memory(source: sqlite3.Connection | None = None) -> sqlite3.Connection:
    """A memory database holding a copy of `source` where that reads whole and is this module's, else empty."""
    db = _connect(":memory:")
    if source is not None:
        try:
            source.backup(db)
            if (db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
                    and db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION):
                return db
        except sqlite3.Error:
            pass
        db.close()
        db = _connect(":memory:")
    _create_schema(db)
    return db


def _reason(path: Path, error: Exception) -> str:
    """Why the file cannot hold the chats, as the rest of a sentence that starts with its path."""
    if isinstance(error, _Unusable):
        return str(error)
    if path.is_dir():
        return "is a folder, not a file"
    if isinstance(error, OSError):
        return f"cannot be created ({error.filename}: {error.strerror})"
    code = getattr(error, "sqlite_errorcode", 0) & 0xFF  # the primary code of an extended one
    return f"{SQLITE_REASONS.get(code, 'cannot be used')} ({error})"


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """All or nothing, the write lock taken before anything is read."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _save(db: sqlite3.Connection, chat_id: str, owner: str, messages: list[dict], body: str,
          title: str | None) -> None:
    with _transaction(db):
        row = db.execute("SELECT owner, title FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is not None and row[0] != owner:
            raise KeyError(_missing(chat_id))
        if title is None:
            title = title_of(messages) if row is None or row[1] == NEW_CHAT else row[1]
        now = time.time()
        db.execute("INSERT INTO chats VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                   "title = excluded.title, updated = excluded.updated, size = excluded.size, "
                   "messages = excluded.messages", (chat_id, owner, title, now, now, len(messages), body))


def _missing(chat_id: str) -> str:
    """The same words whether the chat never existed or is someone else's: an id reveals nothing."""
    return f"no chat {chat_id!r} among this user's chats"


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1].rstrip() + "…"


def _clean_title(title: str) -> str:
    """One line, trimmed, at most MAX_TITLE_CHARS: a title is shown in a list."""
    title = " ".join(title.split())
    if not title:
        raise ValueError("a chat's title cannot be empty")
    return _cut(title, MAX_TITLE_CHARS)


def title_of(messages: list[dict]) -> str:
    """The first line the user wrote, in one short line; "New chat" before they write anything."""
    lines = (line for message in messages if message.get("role") == "user"
             for line in str(message.get("text", "")).splitlines() if line.strip())
    first = next(lines, None)
    return NEW_CHAT if first is None else _cut(" ".join(first.split()), TITLE_CHARS)


def _quoted(text: str) -> str:
    return "\n".join(f"> {line}".rstrip() for line in text.splitlines() or [""])


def _fences_closed(text: str) -> str:
    """An answer stopped inside a code block would swallow the rest of the document: close its fence."""
    fences = sum(line.lstrip().startswith("```") for line in text.splitlines())
    return text + "\n```" if fences % 2 else text


def _message_markdown(message: dict) -> list[str]:
    text = message.get("text", "")
    parts = [SPEAKERS.get(message.get("role"), f"**{message.get('role')}**"),
             _fences_closed(text) if message.get("in_context", True) else _quoted(text)]
    if message.get("figures"):
        parts.append(f"*{figures_line(message['figures'])}*")
    if message.get("note"):
        parts.append(f"*{message['note']}*")
    return parts


def _date(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))


def chat_markdown(chat: StoredChat) -> str:
    """The chat as a document to read or share: each message verbatim (it is Markdown already), each answer's
    figures and note beneath it, notices the model did not read as quotes."""
    parts = [f"# {chat.title}", f"*{_date(chat.created)} – {_date(chat.updated)}*"]
    for message in chat.messages:
        parts += _message_markdown(message)
    return "\n\n".join(part for part in parts if part) + "\n"


def chat_json(chat: StoredChat) -> str:
    """The chat whole, tokens and figures included, for import_chat here or elsewhere."""
    return json.dumps({"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "title": chat.title,
                       "created": chat.created, "updated": chat.updated, "messages": chat.messages},
                      indent=1, ensure_ascii=False)


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(
        type(value), "a number")


def _checked_message(message: object, index: int) -> dict:
    """The message with every field the app reads, of the type it expects; ValueError naming it (from 1) if not."""
    where = f"message {index + 1}"
    if not isinstance(message, dict):
        raise ValueError(f"{where} is {_kind(message)}, not an object")
    if message.get("role") not in ROLES:
        raise ValueError(f"{where} has role {message.get('role')!r}, not 'user' or 'assistant'")
    if not isinstance(message.get("text"), str):
        raise ValueError(f"{where} has no text string (its text is {_kind(message.get('text'))})")
    checked = {"role": message["role"], "text": message["text"]}
    for key, (kind, default) in MESSAGE_FIELDS.items():
        value = message.get(key)
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{where} has {key} {_kind(value)}, not {_kind(kind())}")
        checked[key] = default if value is None else value
    return checked


def parse_chat_json(text: str | bytes) -> tuple[str, list[dict]]:
    """(title, messages) of a chat_json export, checked: a file from elsewhere must not break the chat later.
    ValueError with the reason."""
    try:
        data = json.loads(text)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"not a chat export: the file is not JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a chat export: the JSON is {_kind(data)}, not an object")
    if data.get("format") != EXPORT_FORMAT:
        raise ValueError(f"not a chat export: format is {data.get('format')!r}, not {EXPORT_FORMAT!r}")
    if data.get("version") != EXPORT_VERSION:
        raise ValueError(f"unsupported chat export version {data.get('version')!r} (this app reads version "
                         f"{EXPORT_VERSION})")
    if not isinstance(data.get("messages"), list):
        raise ValueError(f"the chat export has no list of messages (messages is {_kind(data.get('messages'))})")
    messages = [_checked_message(message, index) for index, message in enumerate(data["messages"])]
    title = data.get("title")
    return (_clean_title(title) if isinstance(title, str) and title.strip() else title_of(messages)), messages
