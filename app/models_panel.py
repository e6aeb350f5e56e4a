"""The Models tab: the GGUF models found on this machine (app/models.py), a path typed in, the heads that fit the
chosen model, and the swap of the one engine every session shares (ChatService.swap), with a progress bar."""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from markdown_it.common.utils import escapeHtml

from engine.draft.checkpoint import DEFAULT_HEAD

from .chat import LOAD_FAILURES, Busy, ChatService, Names, first_line
from .figures import METHOD_NAMES
from .models import (
    HeadInfo, ModelFolders, ModelInfo, describe, describe_head, find_heads, find_models, head_fit, heads_for,
    load_options, loadable_path, machine_memory, memory_verdict,
)

log = logging.getLogger(__name__)
NO_HEAD = "none"
LOAD_POLL_S = 0.25
LOAD_RATE = 150e6  # bytes a second a cached GGUF loads at: the progress bar's pace (an estimate, not a promise)
COMPLETING = ("<p><strong>This model has no chat template</strong> (or the app runs with --no-chat-template): each "
              "message is continued as plain text, not answered as in a chat.</p>")


@dataclass
class ModelsTab:
    listing: gr.HTML
    choice: gr.Dropdown
    refresh: gr.Button
    path: gr.Textbox
    info: gr.HTML
    head: gr.Dropdown
    load: gr.Button
    status: gr.HTML


class ModelsPanel:
    """What the Models tab does: list, describe, match heads, load. Loading swaps the engine for every session."""

    def __init__(self, service: ChatService, folders: ModelFolders):
        self.service, self.folders = service, folders
        self._loading = threading.Lock()

    # What there is ---------------------------------------------------------------------------------------------
    def models(self) -> list[ModelInfo]:
        return find_models(self.folders)

    def heads(self) -> list[HeadInfo]:
        return find_heads(self.folders)

    def listing_html(self) -> str:
        """Every model found, described: what it is, whether it runs on the fast exact path, what memory it needs."""
        _, available = machine_memory()
        rows = "".join(_model_row(model, available) for model in self.models())
        if not rows:
            return '<p class="models-empty">No GGUF models found. Type a path below, or put .gguf files in ' \
                   f'{escapeHtml(str(self.folders.models))}.</p>'
        return ('<table class="models"><thead><tr><th>model</th><th>from</th><th>architecture</th><th>size</th>'
                '<th>tensor types</th><th>context</th><th>fast exact path</th><th>memory</th></tr></thead>'
                f"<tbody>{rows}</tbody></table>")

    def choices(self) -> list[tuple[str, str]]:
        return [(model.id, str(loadable_path(model))) for model in self.models() if model.problem is None]

    def model_at(self, path: str) -> ModelInfo:
        """The model a path names: a listed one keeps its name and source (the embedded default stays itself),
        another is described as imported."""
        typed = Path(path.strip()).expanduser()
        listed = next((m for m in self.models() if typed in (m.path, loadable_path(m))), None)
        return listed or describe(typed)

    def refreshed(self):
        return self.listing_html(), gr.update(choices=self.choices())

    # A chosen model --------------------------------------------------------------------------------------------
    def inspect(self, path: str):
        """The model a path names, in words, and the heads for it: the fitting ones first, each other one with why it
        does not fit (a head may also be typed in as a folder)."""
        path = (path or "").strip()
        if not path:
            return "", gr.update(choices=[(NO_HEAD, NO_HEAD)], value=NO_HEAD)
        model = self.model_at(path)
        _, available = machine_memory()
        info = _model_info_html(model, available)
        if model.problem is not None:
            return info, gr.update(choices=[(NO_HEAD, NO_HEAD)], value=NO_HEAD)
        heads = sorted(self.heads(), key=lambda head: (head.path != DEFAULT_HEAD, head.kind != "eagle3", head.id))
        fits = heads_for(model, heads)
        choices = [(f"{head.id} — fits ({head.kind})", str(head.path)) for head, why in fits if why is None]
        choices += [(NO_HEAD, NO_HEAD)]
        choices += [(f"{head.id} — does not fit: {why}", str(head.path)) for head, why in fits if why is not None]
        return info, gr.update(choices=choices, value=choices[0][1])

    def load(self, path: str, head: str, progress=gr.Progress()):
        """Swap the engine for the model at `path` with `head`: checked first (a GGUF that reads, memory enough, a
        head that fits), then loaded while the old engine keeps answering; a load that fails leaves it in place.
        Returns the status, the page's description of the engine, the method choice and the answer length's slider."""
        unchanged = (gr.skip(),) * 3
        try:
            model, head_info = self._checked(path, head)
        except ValueError as err:
            return model_status_html(self.service, problem=str(err)), *unchanged
        if not self._loading.acquire(blocking=False):
            return model_status_html(self.service, problem="another model is being loaded: wait for it"), *unchanged
        try:
            self._swap(model, head_info, progress)
        except Busy as err:
            return model_status_html(self.service, problem=f"not loaded: {err}"), *unchanged
        except LOAD_FAILURES as err:
            log.warning("loading %s failed: %s", model.path, err)
            return model_status_html(self.service, problem=f"{model.id} could not be loaded ({first_line(err)}); the "
                                "model before keeps answering"), *unchanged
        finally:
            self._loading.release()
        return model_status_html(self.service), *self.engine_controls()

    def _checked(self, path: str, head: str) -> tuple[ModelInfo, HeadInfo | None]:
        """The model and head to load, or ValueError saying why not, before anything is loaded."""
        if not (path or "").strip():
            raise ValueError("type the path of a .gguf file, or choose a model above")
        model = self.model_at(path)
        if model.problem is not None:
            raise ValueError(f"{path.strip()} cannot be loaded: {model.problem}")
        _, available = machine_memory()
        if model.memory is not None and model.memory > available:
            raise ValueError(f"{model.id} {memory_verdict(model, available)}")
        if not head or head == NO_HEAD:
            return model, None
        head_info = next((h for h in self.heads() if str(h.path) == head or h.id == head), None)
        if head_info is None:  # a head folder typed in
            head_info = describe_head(Path(head).expanduser())
        if (why := head_fit(head_info, model)) is not None:
            raise ValueError(f"head {head_info.id} does not fit {model.id}: {why}")
        return model, head_info

    def _swap(self, model: ModelInfo, head: HeadInfo | None, progress: gr.Progress) -> None:
        """service.swap on a thread of its own, the progress bar moving meanwhile at the pace the file's size sets."""
        options, names = load_options(self.service.options, model, head), Names(model.id, head and head.id)
        start, expected_s = time.monotonic(), 2 + model.size / LOAD_RATE
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="load") as pool:
            loading = pool.submit(self.service.swap, options, names)
            while not wait([loading], timeout=LOAD_POLL_S).done:
                elapsed = time.monotonic() - start
                progress(1 - math.exp(-elapsed / expected_s), desc=f"Loading {model.id}: {elapsed:.0f} s")
        loading.result()  # a failed load's error, raised here
        log.info("loaded %s with head %s", model.path, head.path if head else None)

    def engine_controls(self):
        """The controls that depend on the engine, for the one loaded now: the description, the methods, the length."""
        methods = self.service.methods
        length = self.service.engine.max_context
        return (description_html(self.service), gr.update(choices=_method_choices(methods), value=methods[0]),
                gr.update(maximum=length))


def _method_choices(methods: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(METHOD_NAMES[m], m) for m in methods]


def description_html(service: ChatService) -> str:
    """What runs now, as the page's header says it (read again after every swap and on every page load)."""
    engine = service.engine
    lines = engine.description().lines()
    return (f"<p>Here lossless is {escapeHtml(engine.exactness)}.</p>{'' if engine.chats else COMPLETING}"
            f'<p class="engine-description">{"<br>".join(map(escapeHtml, lines))}</p>')


def model_status_html(service: ChatService, problem: str | None = None) -> str:
    names = service.names()
    engine = service.engine.description()
    state = "refused" if problem else "loaded"
    text = (f"Answering with {names.base} + {names.head or 'no head'}: {engine.path}." if not problem else
            f"⚠ {problem[:1].upper()}{problem[1:]}. Answering with {names.base} + {names.head or 'no head'}.")
    return (f'<div class="model-status" data-state="{state}" data-base="{escapeHtml(names.base)}" '
            f'data-head="{escapeHtml(names.head or "")}">{escapeHtml(text)}</div>')


def _size(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _types(types: dict[str, int]) -> str:
    return ", ".join(f"{count} {kind}" for kind, count in types.items())


def _model_row(model: ModelInfo, available: int) -> str:
    if model.problem is not None:
        return (f'<tr class="model-problem"><td>{escapeHtml(model.id)}</td><td>{escapeHtml(model.source)}</td>'
                f'<td colspan="6">⚠ {escapeHtml(model.problem)}</td></tr>')
    fast = "yes" if model.fast else f"no: {model.why_not_fast}"
    return (f'<tr title="{escapeHtml(str(model.path))}"><td>{escapeHtml(model.id)}</td>'
            f'<td>{escapeHtml(model.source)}</td>'
            f"<td>{escapeHtml(model.architecture or '?')}</td><td>{_size(model.size)}</td>"
            f"<td>{escapeHtml(_types(model.tensor_types))}</td><td>{_count(model.context_length)}</td>"
            f"<td>{escapeHtml(fast)}</td><td>{escapeHtml(memory_verdict(model, available))}</td></tr>")


def _model_info_html(model: ModelInfo, available: int) -> str:
    if model.problem is not None:
        return f'<div class="model-info" data-state="problem">⚠ {escapeHtml(model.problem)}</div>'
    fast = "runs on the fast exact path" if model.fast else f"not on the fast exact path: {model.why_not_fast}"
    text = (f"{model.id}: {model.architecture}, {_count(model.layers)} layers, hidden size "
            f"{_count(model.hidden_size)}, vocabulary {_count(model.vocab_size)}, context "
            f"{_count(model.context_length)} tokens; {_size(model.size)} "
            f"({_types(model.tensor_types)}); {fast}; {memory_verdict(model, available)}.")
    return f'<div class="model-info" data-state="ok">{escapeHtml(text)}</div>'


def models_tab(panel: ModelsPanel) -> ModelsTab:
    gr.Markdown("Models found on this machine, and any GGUF file by its path. Loading one swaps the engine for every "
                "open page, between answers; the model before keeps answering until the new one is ready.")
    listing = gr.HTML(panel.listing_html, elem_id="models")
    with gr.Row():
        choice = gr.Dropdown(panel.choices(), label="Found models", elem_id="model-choice", value=None, scale=4)
        refresh = gr.Button("Look again", elem_id="refresh-models", size="sm", scale=1)
    path = gr.Textbox(label="GGUF file", placeholder="/path/to/model.gguf", elem_id="model-path", max_lines=1)
    info = gr.HTML(elem_id="model-info")
    head = gr.Dropdown([(NO_HEAD, NO_HEAD)], value=NO_HEAD, label="EAGLE head", elem_id="head-choice",
                       allow_custom_value=True, info="heads that fit the model come first; a head folder may be typed")
    load = gr.Button("Load", variant="primary", elem_id="load-model")
    status = gr.HTML(lambda: model_status_html(panel.service), elem_id="model-status")
    return ModelsTab(listing, choice, refresh, path, info, head, load, status)
