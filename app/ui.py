"""The Gradio Blocks: chat, side-by-side comparison, settings, and the live meter, over one shared ChatService."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import gradio as gr
from markdown_it.common.utils import escapeHtml

from engine import DecodeParams, DynamicTree

from .chat import APP_PARAMS, ChatService
from .conversation import Conversation, Turn, note_turn, user_turn
from .meter import METHOD_NAMES, PLAIN_EVERY, PLAIN_RUN, TurnMeter, meter_html, status_html
from .history import History, HistoryPanel, history_panel
from .models import ModelFolders
from .models_panel import ModelsPanel, ModelsTab, description_html, models_tab
from .store import ChatStore
from .render import render_answer, render_markdown

log = logging.getLogger(__name__)
CSS = Path(__file__).resolve().parents[1] / "assets" / "app.css"
EXAMPLES = Path(__file__).resolve().parents[1] / "assets" / "examples.txt"
EMPTY_HINT = "Type a message first: an empty message is not sent."
BUSY_HINT = "An answer is still being written: wait for it or press Stop."
ANSWER_TOKENS = 1024  # the answer length a page starts with: a real answer, well inside any context
STOP_WAIT_S = 60  # the longest a round can take to finish after Stop, on a slow machine
UPDATE_EVERY_S = 0.5  # page updates while an answer streams; more often costs the decoder (docs/app.md)
# Gradio's queue looks for new events every 1 ms off Windows (every 50 ms there), and for progress every 10 ms:
# over a thousand wake-ups a second, each taking the GIL and a core from the decoder's threads (docs/app.md).
QUEUE_POLL_S = 0.05
# No progress display: even "minimal" redraws its elapsed-time counter every animation frame while an answer
# streams, and on two cores the browser's work is taken from the decoder (docs/app.md).
ENGINE_EVENTS = dict(concurrency_id="engine", concurrency_limit=1, show_progress="hidden")
# Quick steps skip the engine's line but stay queued: only queued events can show a hint (gr.Warning).
QUICK_EVENTS = dict(concurrency_limit=None, show_progress="hidden")
LEGEND = (
    '<div class="legend"><span class="drafted">drafted by EAGLE and accepted</span>'
    '<span class="context">drafted from earlier text and accepted</span>'
    '<span class="base">produced by the base model itself</span></div>'
)
FINISH_NOTES = {
    "length": "Stopped at the token limit (see Settings).", "context": "Stopped: the context window is full."
}
OPTION_TYPES = {  # what each settings control's value becomes (the rest are floats)
    **dict.fromkeys(("max_new_tokens", "total_tokens", "depth", "draft_top_k", "top_k", "seed"), int),
    "method": str, "context": bool, "gate": bool,
    "min_prob": lambda floor: float(floor) or None,  # the slider's 0: the floor a verified row's measured cost sets
}
NO_HEAD = "⚠ No draft head is loaded, so there is no EAGLE answer to compare (start the app with --head)."


def _problem(err: Exception) -> str:
    """What a user is told when a turn fails; the traceback goes to the server log only."""
    if isinstance(err, ValueError):  # the engine's own checks (ContextTooLong among them): clear, meant for users
        return f"⚠ {str(err)[:1].upper()}{str(err)[1:]}."
    log.exception("generation failed")
    return f"⚠ Something went wrong while answering ({type(err).__name__}); the server log has the details."


class Handlers:
    """Event handlers, one method per action; Gradio-independent enough to be driven by tests.

    Settings arrive as keyword options named as DecodeParams.with_options names them (Gradio's inputs_kwargs),
    so no handler depends on the order of the controls on the page.
    """

    def __init__(self, service: ChatService, max_new_tokens: int | None = None, history: History | None = None):
        """max_new_tokens: the longest answer a user may ask for; None: what the model's context holds.
        history: where conversations are kept (None: in memory only)."""
        self.service = service
        self.cap = max_new_tokens
        self.history = history or History(ChatStore(None))

    @property
    def max_new_tokens(self) -> int:
        """The longest answer a user may ask for, on the model loaded now."""
        return min(self.cap or self.service.engine.max_context, self.service.engine.max_context)

    @property
    def default_answer(self) -> int:
        return min(ANSWER_TOKENS, self.max_new_tokens)

    def params(self, **options) -> DecodeParams:
        """The settings controls' values as DecodeParams, the answer length capped at the app's --max-new-tokens;
        EAGLE answers decode a run of PLAIN_RUN plain steps every PLAIN_EVERY rounds for the meter (app/meter.py)."""
        typed = {name: OPTION_TYPES.get(name, float)(value) for name, value in options.items()}
        typed["max_new_tokens"] = max(1, min(typed.get("max_new_tokens", self.default_answer), self.max_new_tokens))
        return APP_PARAMS.with_options(plain_every=PLAIN_EVERY, plain_run=PLAIN_RUN, **typed)

    # Chat tab -----------------------------------------------------------------------------------------------
    def add_message(self, text: str, conversation: Conversation):
        """Put the user's message in the chat at once; the answer follows in the queued step."""
        if conversation.busy:
            gr.Warning(BUSY_HINT)
            return text, conversation, conversation.shown()
        if not (text or "").strip():
            gr.Warning(EMPTY_HINT)
            return "", conversation, conversation.shown()
        conversation.turns.append(user_turn(text))
        return "", conversation, conversation.shown()

    def answer(self, conversation: Conversation, provenance: bool, browser: str = "",
               request: gr.Request | None = None, **options) -> Iterator[tuple]:
        """Stream the answer to the waiting user message, a few updates per second; keep the chat when it ends.
        Yields the conversation, the chat, the meter, then the chat list, the export buttons, the title and the
        store's state (skipped until the answer ends)."""
        kept, owner = (gr.skip(),) * 5, self.history.owner(request, browser)
        if conversation.busy or not conversation.waiting:
            yield conversation, conversation.shown(), gr.skip(), *kept
            return
        conversation.busy = True
        reply = Turn("assistant", "", "")
        try:
            params = self.params(**options)
            engine = self.service.engine
            ids, dropped = self.service.fit(conversation.messages(), params.max_new_tokens)
            conversation.turns.append(reply)
            for answer, meter in self.service.stream(ids, params, every_s=UPDATE_EVERY_S, encoded_by=engine):
                reply.text, reply.answer, reply.meter = answer.text, answer, meter
                reply.html = render_answer(answer, provenance)
                running = reply.meter.finish_reason is None
                if not running:
                    reply.note = self._note(reply.meter, dropped)
                    reply.figures = self.figures(reply.meter)
                    conversation.busy = False
                    yield conversation, conversation.shown(), meter_html(reply.meter, running), \
                        *self.history.after_answer(conversation, owner)
                else:
                    yield conversation, conversation.shown(), meter_html(reply.meter, running), *kept
        except Exception as err:  # a traceback must never reach the page
            if reply.text:
                conversation.turns.append(note_turn(_problem(err)))
            else:  # nothing was answered: take the message out of the model's context, say why
                if reply in conversation.turns:
                    conversation.turns.remove(reply)
                conversation.reject_last(_problem(err))
            conversation.busy = False
            yield conversation, conversation.shown(), meter_html(reply.meter), \
                *self.history.after_answer(conversation, owner)
        finally:
            conversation.busy = False

    def figures(self, meter: TurnMeter) -> dict:
        """A finished answer's figures, with the model and head that wrote it, kept with the reply."""
        names = self.service.names()
        return {**meter.summary(), "model": names.base, "head": names.head if meter.method == "eagle" else None}

    @staticmethod
    def _note(turn: TurnMeter, dropped: int) -> str:
        notes = [FINISH_NOTES.get(turn.finish_reason or "", "")]
        if dropped:
            notes.append(f"The {dropped} oldest messages no longer fit the context and were left out.")
        return " ".join(n for n in notes if n)

    def after_stop(self, conversation: Conversation, browser: str = "", request: gr.Request | None = None):
        """Once the stopped answer has let go of the engine, mark it, settle the meter and keep the chat."""
        deadline = time.monotonic() + STOP_WAIT_S
        while conversation.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        reply = conversation.last_answer()
        if reply is None or reply.meter is None or reply.figures is not None:
            return conversation, conversation.shown(), gr.skip(), *(gr.skip(),) * 5
        if reply.meter.finish_reason is None and not reply.note:
            reply.note = f"Stopped after {len(reply.answer.ids)} tokens."
        reply.figures = self.figures(reply.meter)
        return conversation, conversation.shown(), meter_html(reply.meter), \
            *self.history.after_answer(conversation, self.history.owner(request, browser))

    def regenerate(self, conversation: Conversation):
        if conversation.busy:
            gr.Warning(BUSY_HINT)
        elif not conversation.drop_answer():
            gr.Warning("There is no answer to regenerate yet.")
        return conversation, conversation.shown()

    def clear(self):
        """An empty chat on screen; a kept chat stays in the list (Delete removes it)."""
        return Conversation(), [], meter_html(None)

    def rerender(self, conversation: Conversation, provenance: bool):
        conversation.rerender(provenance)
        return conversation.shown()

    def status(self) -> str:
        return status_html(self.service.rounds, self.service.active)

    # Side-by-side tab ---------------------------------------------------------------------------------------
    def compare(self, text: str, provenance: bool, **options) -> Iterator:
        """Answer one prompt greedily with plain decoding, then with EAGLE, and say whether the outputs match.
        Options as for answer; method, temperature and top-p are the comparison's own."""
        panes, finished = {"vanilla": "", "eagle": ""}, {}
        if not (text or "").strip():
            gr.Warning(EMPTY_HINT)
            yield "", "", "", gr.skip()
            return
        if "eagle" not in self.service.methods:
            yield "", "", _verdict(NO_HEAD), gr.skip()
            return
        try:
            greedy = self.params(**{**options, "temperature": 0.0, "top_p": 1.0})
            engine = self.service.engine
            ids, _ = self.service.fit([{"role": "user", "content": text}], greedy.max_new_tokens)
            for method in ("vanilla", "eagle"):
                params = greedy.with_options(method=method)
                for answer, turn in self.service.stream(ids, params, every_s=UPDATE_EVERY_S, encoded_by=engine):
                    panes[method], finished[method] = render_answer(answer, provenance), (answer, turn)
                    progress = _verdict(f"{METHOD_NAMES[method]} is answering…")
                    yield panes["vanilla"], panes["eagle"], progress, meter_html(turn, running=True)
        except Exception as err:  # a traceback must never reach the page
            yield panes["vanilla"], panes["eagle"], _verdict(_problem(err)), gr.skip()
            return
        verdict = _compare_verdict(finished["vanilla"], finished["eagle"], self._where_they_part(ids, finished))
        yield panes["vanilla"], panes["eagle"], verdict, meter_html(finished["eagle"][1])

    def _where_they_part(self, prompt_ids: list[int], finished: dict) -> str:
        """For outputs that differ: the base model's two likeliest tokens where they part, and how close they are."""
        a, b = finished["vanilla"][0].ids, finished["eagle"][0].ids
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            return ""
        logits = self.service.engine_thread.call(self.service.engine.next_token_logits, prompt_ids + a[:first])
        (top, second), (i, j) = logits.topk(2)
        names = [self.service.engine.tokenizer.decode([int(t)]) for t in (i, j)]
        return (f" There the base model's two likeliest tokens were {names[0]!r} ({top:.4f}) and {names[1]!r} "
                f"({second:.4f}), {top - second:.2g} apart: {self.service.engine.exactness}.")


def _verdict(text: str, state: str = "") -> str:
    return f'<div class="verdict" data-verdict="{state}">{render_markdown(text, "verdict-text")}</div>'


def _compare_verdict(plain, eagle, near_tie: str = "") -> str:
    """The side-by-side verdict; near_tie explains a difference (see Handlers._where_they_part)."""
    (plain_answer, plain_turn), (eagle_answer, eagle_turn) = plain, eagle
    a, b = plain_answer.ids, eagle_answer.ids
    if a == b:
        head = f"✅ Identical: both produced the same {len(a)} tokens."
        state = "identical"
    else:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        head = f"❌ The outputs differ from token {first} on ({len(a)} vs {len(b)} tokens).{near_tie}"
        state = "different"
    speeds = ""
    if plain_turn.tokens_per_s and eagle_turn.tokens_per_s:
        speeds = (
            f" Plain decoding {plain_turn.tokens_per_s:.1f} tokens/s, EAGLE {eagle_turn.tokens_per_s:.1f} tokens/s "
            f"(τ {eagle_turn.tau:.2f}): {eagle_turn.tokens_per_s / plain_turn.tokens_per_s:.2f}× on this prompt."
        )
    return _verdict(head + speeds, state)


def _examples() -> list[str]:
    return [line.strip() for line in EXAMPLES.read_text().splitlines() if line.strip()] if EXAMPLES.exists() else []


@dataclass
class ChatTab:
    chatbot: gr.Chatbot
    prompt: gr.Textbox
    send: gr.Button
    stop: gr.Button
    regenerate: gr.Button
    clear: gr.Button


@dataclass
class CompareTab:
    prompt: gr.Textbox
    button: gr.Button
    stop: gr.Button
    verdict: gr.HTML
    plain: gr.HTML
    eagle: gr.HTML


@dataclass
class SidePanel:
    meter: gr.HTML
    status: gr.HTML
    provenance: gr.Checkbox
    controls: dict[str, gr.components.Component]  # named as DecodeParams.with_options names its options


def _chat_tab() -> ChatTab:
    chatbot = gr.Chatbot(
        elem_id="chat", show_label=False, height=520, render_markdown=False, sanitize_html=True,
        latex_delimiters=[], allow_tags=False, buttons=[], feedback_options=None,
    )
    gr.HTML(LEGEND)
    with gr.Row(equal_height=True):
        prompt = gr.Textbox(elem_id="prompt", show_label=False, placeholder="Message (Enter sends)", lines=1,
                            max_lines=8, scale=6, autofocus=True)
        send = gr.Button("Send", variant="primary", elem_id="send", scale=1, min_width=80)
        stop = gr.Button("Stop", variant="stop", elem_id="stop", scale=1, min_width=80)
    with gr.Row():
        regenerate = gr.Button("Regenerate", size="sm", elem_id="regenerate")
        clear = gr.Button("Clear", size="sm", elem_id="clear")
    if _examples():
        gr.Examples([[e] for e in _examples()], inputs=[prompt], label="Examples")
    return ChatTab(chatbot, prompt, send, stop, regenerate, clear)


def _compare_tab() -> CompareTab:
    gr.Markdown(
        "The same prompt answered twice, greedily: first by plain decoding, then with EAGLE. "
        "Lossless means the two texts are identical, token for token."
    )
    with gr.Row(equal_height=True):
        prompt = gr.Textbox(elem_id="compare-prompt", show_label=False, placeholder="Prompt", scale=6)
        button = gr.Button("Compare", variant="primary", elem_id="compare", scale=1)
        stop = gr.Button("Stop", variant="stop", elem_id="compare-stop", scale=1)
    verdict = gr.HTML(elem_id="verdict")
    with gr.Row():
        with gr.Column():
            gr.Markdown("**Plain decoding**")
            plain = gr.HTML(elem_id="plain-answer", elem_classes=["pane"])
        with gr.Column():
            gr.Markdown("**EAGLE**")
            eagle = gr.HTML(elem_id="eagle-answer", elem_classes=["pane"])
    return CompareTab(prompt, button, stop, verdict, plain, eagle)


def _side_panel(handlers: Handlers) -> SidePanel:
    methods, tree = handlers.service.methods, DynamicTree()
    meter = gr.HTML(meter_html(None), elem_id="meter")
    status = gr.HTML(handlers.status, elem_id="engine-status")  # a callable value is read on every page load
    with gr.Accordion("Settings", open=True):
        controls = {
            "method": gr.Radio([(METHOD_NAMES[m], m) for m in methods], value=methods[0], label="Method",
                               info=None if "eagle" in methods else "No draft head loaded: plain decoding only."),
            "temperature": gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature", info="0 = greedy"),
            "top_p": gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p"),
            "max_new_tokens": gr.Slider(1, handlers.max_new_tokens, value=handlers.default_answer, step=1,
                                        label="Max new tokens", elem_id="max-new-tokens"),
            "total_tokens": gr.Slider(2, 96, value=tree.total_tokens, step=1, label="Tree size",
                                      info="tokens verified per round (root included)"),
            "depth": gr.Slider(1, 10, value=tree.depth, step=1, label="Tree depth"),
            "min_prob": gr.Slider(0.0, 0.95, value=tree.min_prob or 0.0, step=0.05, label="Draft confidence floor",
                                  info="drafts the head gives less probability are not verified; 0: what a "
                                       "verified row costs on this machine, measured"),
            "context": gr.Checkbox(value=True, label="EAGLE drafts from the context too", elem_id="context",
                                   info="continuations of earlier text (this chat, else the model's own replies to "
                                        "other prompts) join the head's tree"),
            "gate": gr.Checkbox(value=APP_PARAMS.gate, label="The head drafts only where it pays", elem_id="gate",
                                info="measured in the answer: rounds with the head against rounds without it"),
        }
        provenance = gr.Checkbox(value=True, label="Colour drafted tokens", elem_id="provenance")
    return SidePanel(meter, status, provenance, controls)


def _wire_chat(handlers: Handlers, conversation: gr.State, chat: ChatTab, side: SidePanel,
               history: HistoryPanel) -> None:
    """Send, Enter, Regenerate, Stop, Clear and the provenance switch. Answers queue on the one engine; each kept in
    the chat list when it ends."""
    answer_inputs = dict(conversation=conversation, provenance=side.provenance, browser=history.browser,
                         **side.controls)
    kept = [history.chats, history.export, history.export_json, history.title, history.saving]
    answer_outputs = [conversation, chat.chatbot, side.meter, *kept]
    answers = []
    for trigger in (chat.prompt.submit, chat.send.click):
        added = trigger(handlers.add_message, [chat.prompt, conversation], [chat.prompt, conversation, chat.chatbot],
                        **QUICK_EVENTS)
        answers.append(added.then(handlers.answer, inputs_kwargs=answer_inputs, outputs=answer_outputs,
                                  **ENGINE_EVENTS))
    dropped = chat.regenerate.click(handlers.regenerate, [conversation], [conversation, chat.chatbot], **QUICK_EVENTS)
    answers.append(dropped.then(handlers.answer, inputs_kwargs=answer_inputs, outputs=answer_outputs, **ENGINE_EVENTS))
    chat.stop.click(None, None, None, cancels=answers).then(
        handlers.after_stop, [conversation, history.browser], [conversation, chat.chatbot, side.meter, *kept],
        **QUICK_EVENTS
    )
    for trigger in (chat.clear.click, chat.chatbot.clear):  # the Chatbot's own bin icon clears the conversation too
        trigger(None, None, None, cancels=answers).then(
            handlers.clear, None, [conversation, chat.chatbot, side.meter], queue=False
        )
    side.provenance.change(handlers.rerender, [conversation, side.provenance], [chat.chatbot], queue=False)


def _wire_history(panel: History, conversation: gr.State, chat: ChatTab, side: SidePanel,
                  history: HistoryPanel) -> None:
    """The chat list: open, new, rename, delete, import; the page's first load lists this user's chats."""
    opened = [conversation, chat.chatbot, history.chats, history.export, history.export_json, history.title]
    history.chats.input(panel.open_chat, [history.chats, conversation, side.provenance, history.browser], opened,
                        **QUICK_EVENTS)
    history.new_chat.click(panel.new_chat, [conversation, history.browser], opened, **QUICK_EVENTS)
    history.delete.click(panel.delete, [conversation, history.browser], opened, **QUICK_EVENTS)
    history.upload.upload(panel.upload, [history.upload, conversation, side.provenance, history.browser], opened,
                          **QUICK_EVENTS)
    renamed = [history.chats, history.title]
    for trigger in (history.rename.click, history.title.submit):
        trigger(panel.rename, [history.title, conversation, history.browser], renamed, **QUICK_EVENTS)


def _wire_models(panel: ModelsPanel, models: ModelsTab, side: SidePanel, description: gr.HTML) -> None:
    """Choose or type a model, see what it is and which heads fit, load it (one load at a time, never mid-answer)."""
    models.choice.input(lambda path: path, [models.choice], [models.path], queue=False).then(
        panel.inspect, [models.path], [models.info, models.head], **QUICK_EVENTS)
    for trigger in (models.path.submit, models.path.blur):
        trigger(panel.inspect, [models.path], [models.info, models.head], **QUICK_EVENTS)
    models.refresh.click(panel.refreshed, None, [models.listing, models.choice], **QUICK_EVENTS)
    models.load.click(panel.load, [models.path, models.head],
                      [models.status, description, side.controls["method"], side.controls["max_new_tokens"]],
                      concurrency_id="load", concurrency_limit=1, show_progress="full",
                      show_progress_on=[models.status])


def _wire_compare(handlers: Handlers, compare: CompareTab, side: SidePanel) -> None:
    shared = ("max_new_tokens", "total_tokens", "depth", "min_prob", "gate")
    inputs = dict(text=compare.prompt, provenance=side.provenance, **{name: side.controls[name] for name in shared})
    outputs = [compare.plain, compare.eagle, compare.verdict, side.meter]
    comparisons = [trigger(handlers.compare, inputs_kwargs=inputs, outputs=outputs, **ENGINE_EVENTS)
                   for trigger in (compare.prompt.submit, compare.button.click)]
    compare.stop.click(None, None, None, cancels=comparisons)


def poll_queue_gently(demo: gr.Blocks) -> None:
    """Make the queue of `demo` (after demo.queue()) look for work every QUEUE_POLL_S, as Gradio does on Windows: a
    new event may wait that long to start, a wait nobody sees, and the decoder keeps its cores."""
    demo._queue.sleep_when_free = QUEUE_POLL_S
    demo._queue.progress_update_sleep_when_free = QUEUE_POLL_S


def build_demo(service: ChatService, max_new_tokens: int | None = None, title: str = "EAGLE chat",
               store: ChatStore | None = None, folders: ModelFolders | None = None, shared: bool = False) -> gr.Blocks:
    """The whole page. Every generation shares the concurrency group "engine": one at a time, others queue.
    store: where chats are kept (None: in memory); folders: where the Models tab looks (None: the user's usual ones);
    shared: the page is on a public link, where a visitor who has not signed in sees only this browser's chats."""
    history = History(store or ChatStore(None), shared)
    handlers = Handlers(service, max_new_tokens, history)
    models = ModelsPanel(service, folders or ModelFolders.default())
    with gr.Blocks(title=title, analytics_enabled=False) as demo:  # no calls home from a local app
        conversation = gr.State(Conversation())
        gr.HTML(
            f'<div class="app-header"><h1>{title}</h1><p>Lossless speculative decoding: a small EAGLE head drafts '
            "tokens and the base model checks them all in one pass, so the text is what the base model alone would "
            "write.</p></div>"
        )
        description = gr.HTML(lambda: description_html(service), elem_id="engine-description")
        with gr.Row():
            with gr.Column(scale=1, min_width=200):
                chats = history_panel(shared)
            with gr.Column(scale=3):
                with gr.Tabs():
                    with gr.Tab("Chat"):
                        chat = _chat_tab()
                    with gr.Tab("Side by side"):
                        compare = _compare_tab()
                    with gr.Tab("Models", elem_id="models-tab"):
                        models_ui = models_tab(models)
            with gr.Column(scale=1, min_width=280):
                side = _side_panel(handlers)
        gr.Timer(1.0).tick(handlers.status, None, side.status, queue=False, show_progress="hidden")
        demo.load(history.open_page, [chats.browser], [chats.browser, chats.chats, chats.saving], **QUICK_EVENTS)
        _wire_chat(handlers, conversation, chat, side, chats)
        _wire_history(history, conversation, chat, side, chats)
        _wire_compare(handlers, compare, side)
        _wire_models(models, models_ui, side, description)
    return demo
