"""Streamed tokens -> safe HTML that shows which tokens came from accepted drafts.

The answer is Markdown rendered on the server (markdown-it, raw HTML off), so the model's text is never
interpreted as HTML, and provenance spans are placed *inside* the rendered text nodes: they can never cut a
Markdown construct or a fenced code block in half. Every token gets a span titled with its index (a tooltip
in the page), an empty one when it shows no character of its own (Markdown syntax, a byte of an unfinished
character, a stop token), so the drafted, context and base spans account for each token exactly once. (`title` and
`class` survive Gradio's HTML sanitizer; `data-` attributes do not.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from transformers import PreTrainedTokenizerBase

DRAFTED, CONTEXT, BASE = "drafted", "context", "base"  # context: a draft copied from earlier text
_INCOMPLETE = "\ufffd"  # what decode() shows for the bytes of a character that is not finished yet


class TokenText:
    """Incremental detokenizer: one text piece per token, in order, whose concatenation is the decoded text.

    It decodes a short window of recent ids twice and keeps the difference, the way streaming servers do, so a
    token's leading space and merged characters come out right for any tokenizer. A token that ends inside a
    multi-byte character gets an empty piece; the token that completes the character carries it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start: decoding from here gives stable text
        self._read = 0  # ids up to here are already in the emitted text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if text.endswith(_INCOMPLETE) or len(text) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back when the stream ends (an unfinished character shows as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(before) :]


@dataclass
class Answer:
    """One streamed answer: its token ids, each token's text piece, which came from accepted drafts, and which of
    those the context drafted (engine.draft.context) rather than the head."""

    ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)
    from_context: list[bool] = field(default_factory=list)

    def add(
        self, tokens: list[int], drafted: list[bool], detokenizer: TokenText, from_context: list[bool] | None = None
    ) -> None:
        for token, was_drafted, copied in zip(tokens, drafted, from_context or [False] * len(tokens), strict=True):
            self.ids.append(token)
            self.pieces.append(detokenizer.add(token))
            self.drafted.append(was_drafted)
            self.from_context.append(copied)

    def kind(self, token: int) -> str:
        """The token's provenance class: drafted by the head, drafted from the context, or the base model's."""
        return CONTEXT if self.from_context[token] else DRAFTED if self.drafted[token] else BASE

    def finish(self, detokenizer: TokenText) -> None:
        """Give bytes still held back to the last token."""
        if self.pieces:
            self.pieces[-1] += detokenizer.flush()

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class _Provenance:
    """Wraps rendered text in per-token spans by walking the source text alongside the renderer.

    markdown-it renders text in source order and only ever drops characters (syntax, escapes), so each rendered
    character is found at or after the previous one's source position.
    """

    def __init__(self, answer: Answer):
        self.source = answer.text
        self.owner = [i for i, piece in enumerate(answer.pieces) for _ in piece]
        self.answer = answer
        self.cursor = 0  # source position after the last matched character
        self.shown = 0  # tokens below this index already have a span

    def _span(self, token: int, text: str) -> str:
        return f'<span class="{self.answer.kind(token)}" title="token {token}">{escapeHtml(text)}</span>'

    def _catch_up(self, token: int) -> str:
        """Empty spans for tokens before `token` that showed no character."""
        skipped = "".join(self._span(t, "") for t in range(self.shown, token))
        self.shown = max(self.shown, token + 1)
        return skipped

    def wrap(self, text: str) -> str:
        out, run, run_owner = [], [], None
        for char in text:
            position = self.source.find(char, self.cursor)
            if position >= 0:
                self.cursor = position + 1
            owner = self.owner[self.cursor - 1] if self.cursor else 0  # unmatched: the last token seen
            if owner != run_owner and run:
                out.append(self._span(run_owner, "".join(run)))
                run = []
            if owner != run_owner:
                out.append(self._catch_up(owner))
            run_owner = owner
            run.append(char)
        if run:
            out.append(self._span(run_owner, "".join(run)))
        return "".join(out)

    def rest(self) -> str:
        return self._catch_up(len(self.answer.ids)) if self.shown < len(self.answer.ids) else ""


def _wrap(env: dict, text: str) -> str:
    provenance = env.get("provenance")
    return provenance.wrap(text) if provenance else escapeHtml(text)


def _text(renderer, tokens, idx, options, env) -> str:
    return _wrap(env, tokens[idx].content)


def _code_inline(renderer, tokens, idx, options, env) -> str:
    return f"<code>{_wrap(env, tokens[idx].content)}</code>"


def _code_block(renderer, tokens, idx, options, env) -> str:
    token = tokens[idx]
    language = token.info.strip().split(maxsplit=1)[0] if token.info.strip() else ""
    label = f' class="language-{escapeHtml(language)}"' if language else ""
    return f"<pre><code{label}>{_wrap(env, token.content)}</code></pre>\n"


def _markdown() -> MarkdownIt:
    """CommonMark with tables and strikethrough; raw HTML, entities and images off (no remote fetches)."""
    md = MarkdownIt("commonmark", {"html": False, "breaks": True})
    md.enable(["table", "strikethrough"]).disable(["entity", "image"])
    rules = {"text": _text, "code_inline": _code_inline, "fence": _code_block, "code_block": _code_block}
    for rule, function in rules.items():
        md.add_render_rule(rule, function)
    return md


_MD = _markdown()


def render_markdown(text: str, kind: str = "user") -> str:
    """Safe HTML for a message with no provenance: a user's message, a notice, or an answer with provenance off."""
    return f'<div class="eagle-msg eagle-{kind}">{_MD.render(text, {})}</div>'


def render_answer(answer: Answer, provenance: bool = True) -> str:
    """Safe HTML for an answer, with a span per token marking where it came from when `provenance` is on."""
    if not provenance:
        return render_markdown(answer.text, "answer")
    spans = _Provenance(answer)
    body = _MD.render(answer.text, {"provenance": spans})
    return f'<div class="eagle-msg eagle-answer">{body}{spans.rest()}</div>'
