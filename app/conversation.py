"""One browser session's conversation: what the model reads and what the chat shows, kept in one list; as records
for the chat store (app/store.py) and back."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .meter import TurnMeter, figures_html
from .render import Answer, render_answer, render_markdown

SHOWN_CHARS = 20_000  # longer messages are shown cut (the model still reads them whole)


@dataclass
class Turn:
    role: str  # "user" or "assistant"
    text: str  # what the model reads
    html: str  # what the chat shows
    in_context: bool = True  # False for notes the model must not read (errors, a rejected message)
    answer: Answer | None = None  # an assistant turn's tokens, to render again when provenance is switched
    meter: TurnMeter | None = None  # an assistant turn's live figures while it streams
    note: str = ""  # a line under an answer: how it ended
    figures: dict | None = None  # a finished answer's figures (TurnMeter.summary, the model and head): kept with it

    def record(self) -> dict:
        """The turn as the chat store keeps it and the JSON export carries it."""
        return {"role": self.role, "text": self.text, "in_context": self.in_context, "note": self.note,
                "figures": self.figures, "answer": asdict(self.answer) if self.answer is not None else None}


def turn_of(record: dict, provenance: bool = True) -> Turn:
    """A stored or imported turn, rendered again: an answer with its tokens' provenance, where it kept them."""
    answer = Answer(**record["answer"]) if record.get("answer") else None
    if record["role"] == "user":
        turn = user_turn(record["text"])
    elif answer is not None:
        turn = Turn("assistant", record["text"], render_answer(answer, provenance), answer=answer)
    elif record.get("in_context", True):
        turn = Turn("assistant", record["text"], render_markdown(record["text"], "answer"))
    else:
        turn = note_turn(record["text"])
    turn.in_context = record.get("in_context", True)
    turn.note, turn.figures = record.get("note") or "", record.get("figures")
    return turn


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
    chat_id: str | None = None  # its id in the chat store, once saved
    title: str = ""

    @classmethod
    def of_records(cls, records: list[dict], chat_id: str, title: str, provenance: bool = True) -> Conversation:
        return cls([turn_of(record, provenance) for record in records], chat_id=chat_id, title=title)

    def records(self) -> list[dict]:
        return [turn.record() for turn in self.turns]

    def messages(self) -> list[dict]:
        """The conversation as the model reads it."""
        return [{"role": t.role, "content": t.text} for t in self.turns if t.in_context]

    def shown(self) -> list[dict]:
        """The conversation as the Chatbot shows it: role/content messages whose content is safe HTML, each finished
        answer with its figures beneath it (collapsed)."""
        return [{"role": t.role, "content": t.html + _note(t.note) + (figures_html(t.figures) if t.figures else "")}
                for t in self.turns]

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
