"""One browser session's conversation: what the model reads and what the chat shows, kept in one list."""
from __future__ import annotations

from dataclasses import dataclass, field

from .meter import TurnMeter
from .render import Answer, render_answer, render_markdown

SHOWN_CHARS = 20_000  # longer messages are shown cut (the model still reads them whole)


@dataclass
class Turn:
    role: str  # "user" or "assistant"
    text: str  # what the model reads
    html: str  # what the chat shows
    in_context: bool = True  # False for notes the model must not read (errors, a rejected message)
    answer: Answer | None = None  # an assistant turn's tokens, to render again when provenance is switched
    meter: TurnMeter | None = None  # an assistant turn's figures
    note: str = ""  # a line under an answer: how it ended


def user_turn(text: str) -> Turn:
    shown = text
    if len(text) > SHOWN_CHARS:
        shown = text[:SHOWN_CHARS] + f"\n\n… ({len(text) - SHOWN_CHARS} more characters)"
    return Turn("user", text, render_markdown(shown))


def note_turn(text: str) -> Turn:
    """An assistant-side notice (an error, a rejected message) shown in the chat and hidden from the model."""
    return Turn("assistant", text, render_markdown(text, "notice"), in_context=False)


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)
    busy: bool = False  # an answer is streaming into this conversation

    def messages(self) -> list[dict]:
        """The conversation as the model reads it."""
        return [{"role": t.role, "content": t.text} for t in self.turns if t.in_context]

    def shown(self) -> list[dict]:
        """The conversation as the Chatbot shows it: role/content messages whose content is safe HTML."""
        return [{"role": t.role, "content": t.html + _note(t.note)} for t in self.turns]

    @property
    def waiting(self) -> bool:
        """The model has a user message to answer."""
        context = [t for t in self.turns if t.in_context]
        return bool(context) and context[-1].role == "user"

    def last_answer(self) -> Turn | None:
        context = [t for t in self.turns if t.in_context]
        return context[-1] if context and context[-1].role == "assistant" else None

    def reject_last(self, reason: str) -> None:
        """Keep the last user message on screen, out of the model's context, with the reason beneath it."""
        for turn in reversed(self.turns):
            if turn.in_context and turn.role == "user":
                turn.in_context = False
                break
        self.turns.append(note_turn(reason))

    def drop_answer(self) -> bool:
        """Remove the last answer and any notes after it, so the last user message is answered again."""
        answer = self.last_answer()
        if answer is None:
            return False
        del self.turns[self.turns.index(answer) :]
        return True

    def rerender(self, provenance: bool) -> None:
        for turn in self.turns:
            if turn.answer is not None:
                turn.html = render_answer(turn.answer, provenance)


def _note(note: str) -> str:
    return render_markdown(note, "answer-note") if note else ""
