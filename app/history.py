"""The chat list beside the chat: every conversation kept in the chat store (app/store.py), reopened, renamed,
deleted, exported as Markdown and JSON, imported again. Each user sees only their own chats."""
from __future__ import annotations

import logging
import re
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from markdown_it.common.utils import escapeHtml

from .conversation import Conversation
from .store import ChatStore, StoredChat, chat_json, chat_markdown

log = logging.getLogger(__name__)
LOCAL = "local"  # the one user of an app on this machine alone
EXPORTS = Path(tempfile.gettempdir()) / "eagle-chat-exports"  # served by Gradio from the temporary folder


def owner_of(request: gr.Request | None, browser: str | None, shared: bool) -> str:
    """Whose chats a page shows: the signed-in user's (--auth); on a public link without sign-in, this browser's own
    (a random id it keeps); on this machine alone, the local user's."""
    if request is not None and request.username:
        return f"user:{request.username}"
    if shared:
        return f"browser:{browser or 'unknown'}"
    return LOCAL


@dataclass
class HistoryPanel:
    browser: gr.BrowserState | gr.State  # a random id this browser keeps: its chats' owner on a public link
    new_chat: gr.Button
    chats: gr.Radio
    saving: gr.HTML
    title: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    export: gr.DownloadButton
    export_json: gr.DownloadButton
    upload: gr.UploadButton


def history_panel(shared: bool) -> HistoryPanel:
    """shared: a public page, where a visitor's browser keeps an id of its own (in localStorage) to own its chats;
    on this machine alone nothing is kept in the browser."""
    browser = gr.BrowserState("", storage_key="eagle-chat-browser") if shared else gr.State("")
    new_chat = gr.Button("New chat", elem_id="new-chat", size="sm", variant="secondary")
    chats = gr.Radio([], label="Chats", elem_id="history", elem_classes=["history"])
    saving = gr.HTML(elem_id="store-status")
    with gr.Accordion("This chat", open=False, elem_id="chat-actions"):
        title = gr.Textbox(label="Title", elem_id="chat-title", max_lines=1)
        with gr.Row():
            rename = gr.Button("Rename", elem_id="rename", size="sm")
            delete = gr.Button("Delete", elem_id="delete-chat", size="sm", variant="stop")
        export = gr.DownloadButton("Export Markdown", elem_id="export", size="sm", interactive=False)
        export_json = gr.DownloadButton("Export JSON", elem_id="export-json", size="sm", interactive=False)
        upload = gr.UploadButton("Import JSON", elem_id="import", size="sm", file_types=[".json"], type="binary")
    return HistoryPanel(browser, new_chat, chats, saving, title, rename, delete, export, export_json, upload)


class History:
    """The chat store as the page uses it: a conversation saved when an answer ends, the list, open, rename, delete,
    export and import. Handlers never raise into the page: a store that cannot write says so and the chat goes on."""

    def __init__(self, store: ChatStore, shared: bool = False):
        self.store, self.shared = store, shared

    def owner(self, request: gr.Request | None, browser: str | None) -> str:
        return owner_of(request, browser, self.shared)

    def saving_html(self) -> str:
        if self.store.problem is None:
            return ""
        return f'<div class="store-problem">⚠ {escapeHtml(self.store.problem)}</div>'

    def listing(self, owner: str, selected: str | None = None) -> dict:
        """The chat list, newest first, with `selected` marked."""
        chats = self.store.chats(owner)
        return gr.update(choices=[(chat.title, chat.id) for chat in chats],
                         value=selected if any(chat.id == selected for chat in chats) else None)

    def save(self, conversation: Conversation, owner: str) -> StoredChat | None:
        """Keep the conversation as it stands (called when an answer ends, however it ended); the chat as kept."""
        if not conversation.turns:
            return None
        if conversation.chat_id is None:
            conversation.chat_id = self.store.create(owner)
        self.store.save(conversation.chat_id, owner, conversation.records())
        chat = self.store.load(conversation.chat_id, owner)
        conversation.title = chat.title
        return chat

    @staticmethod
    def exports(chat: StoredChat | None) -> tuple[dict, dict]:
        """The two download buttons, holding a kept chat as Markdown and as JSON (greyed out for one not kept yet)."""
        if chat is None:
            return gr.update(value=None, interactive=False), gr.update(value=None, interactive=False)
        folder = EXPORTS / uuid.uuid4().hex  # one folder per export: a file name is the chat's title
        folder.mkdir(parents=True)
        name = _file_name(chat.title)
        markdown, json = folder / f"{name}.md", folder / f"{name}.json"
        markdown.write_text(chat_markdown(chat), encoding="utf-8")
        json.write_text(chat_json(chat), encoding="utf-8")
        return gr.update(value=str(markdown), interactive=True), gr.update(value=str(json), interactive=True)

    def after_answer(self, conversation: Conversation, owner: str) -> tuple[dict, dict, dict, str, str]:
        """Save, then what the page shows of it: the list, the title, the export buttons, the store's state."""
        chat = self.save(conversation, owner)
        return (self.listing(owner, conversation.chat_id), *self.exports(chat), conversation.title,
                self.saving_html())

    # Page events ---------------------------------------------------------------------------------------------
    def open_page(self, browser: str, request: gr.Request):
        """On page load: this browser's id (made on its first visit), its owner's chats and the store's state."""
        browser = browser or uuid.uuid4().hex
        return browser, self.listing(self.owner(request, browser)), self.saving_html()

    def open_chat(self, chat_id: str | None, conversation: Conversation, provenance: bool, browser: str,
                  request: gr.Request):
        """Reopen a kept chat, to read or to continue."""
        owner = self.owner(request, browser)
        if conversation.busy:
            gr.Warning("An answer is still being written: wait for it or press Stop, then open another chat.")
            return conversation, gr.skip(), self.listing(owner, conversation.chat_id), gr.skip(), gr.skip(), gr.skip()
        if not chat_id:
            return conversation, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        try:
            chat = self.store.load(chat_id, owner)
        except KeyError:
            gr.Warning("That chat is no longer there.")
            return conversation, gr.skip(), self.listing(owner, conversation.chat_id), gr.skip(), gr.skip(), gr.skip()
        opened = _conversation(chat, provenance)
        return (opened, opened.shown(), gr.skip(), *self.exports(chat), opened.title)

    def new_chat(self, conversation: Conversation, browser: str, request: gr.Request):
        if conversation.busy:
            gr.Warning("An answer is still being written: wait for it or press Stop first.")
            return conversation, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        owner = self.owner(request, browser)
        return (Conversation(), [], self.listing(owner), *self.exports(None), "")

    def rename(self, title: str, conversation: Conversation, browser: str, request: gr.Request):
        owner = self.owner(request, browser)
        if conversation.chat_id is None:
            gr.Warning("This chat is saved once its first answer ends; rename it then.")
            return gr.skip(), ""
        try:
            self.store.rename(conversation.chat_id, owner, title)
        except (KeyError, ValueError) as err:
            gr.Warning(str(err).strip("'\""))
            return gr.skip(), conversation.title
        conversation.title = self.store.load(conversation.chat_id, owner).title
        return self.listing(owner, conversation.chat_id), conversation.title

    def delete(self, conversation: Conversation, browser: str, request: gr.Request):
        owner = self.owner(request, browser)
        if conversation.busy:
            gr.Warning("An answer is still being written: wait for it or press Stop first.")
            return conversation, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        if conversation.chat_id is not None:
            try:
                self.store.delete(conversation.chat_id, owner)
            except KeyError:
                pass  # gone already: the page shows the list as it is
        return (Conversation(), [], self.listing(owner), *self.exports(None), "")

    def upload(self, data: bytes, conversation: Conversation, provenance: bool, browser: str, request: gr.Request):
        """Import a chat exported as JSON (here or on another machine) as a new chat, and open it."""
        owner = self.owner(request, browser)
        if conversation.busy:
            gr.Warning("An answer is still being written: wait for it or press Stop first.")
            return conversation, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        try:
            chat_id = self.store.import_chat(owner, data)
        except ValueError as err:
            gr.Warning(f"That file cannot be imported: {err}")
            return conversation, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        chat = self.store.load(chat_id, owner)
        opened = _conversation(chat, provenance)
        return (opened, opened.shown(), self.listing(owner, chat_id), *self.exports(chat), opened.title)


def _conversation(chat: StoredChat, provenance: bool) -> Conversation:
    return Conversation.of_records(chat.messages, chat.id, chat.title, provenance)


def _file_name(title: str) -> str:
    return re.sub(r"[^\w\- ]+", "", title).strip().replace(" ", "-")[:60] or "chat"
