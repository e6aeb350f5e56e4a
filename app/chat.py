"""The one engine every browser session shares: a chat turn as a stream of (answer, meter) updates, one per round.

No Gradio here: the UI turns these updates into HTML, and tests drive the service directly.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any, Callable, Iterator, TypeVar

from engine import ContextTooLong, DecodeParams, Engine

from .meter import Baseline, TurnMeter
from .render import Answer, TokenText

CALIBRATION_PROMPT = [{"role": "user", "content": "Describe the sea in a few sentences."}]
MIN_BASELINE_TOKENS = 8  # a plain-decoding turn shorter than this says little about speed
T = TypeVar("T")
_END = object()


class EngineThread:
    """One long-lived thread for every engine call of the app, the model load included.

    Why: each thread that runs torch CPU work gets its own OpenMP team. Gradio calls a generator's steps from
    any of its worker threads, and once a second team exists on a 2-core machine decoding ran at about half
    speed (plain decoding 10-12 instead of 18-20 tokens/s, measured in the app and in a bare script).
    """

    def __init__(self) -> None:
        self._start()
        os.register_at_fork(after_in_child=self._start)  # ZeroGPU runs the stream in a forked process

    def _start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._executor.submit(function, *args, **kwargs).result()

    def iterate(self, iterator: Iterator[T]) -> Iterator[T]:
        """The items of `iterator`, each computed on the engine thread."""
        while (item := self.call(next, iterator, _END)) is not _END:
            yield item


class ChatService:
    """Chat turns over one engine, with the plain decoding baseline and counters shown to every session."""

    def __init__(self, engine: Engine, engine_thread: EngineThread | None = None):
        self.engine = engine
        self.engine_thread = engine_thread or EngineThread()
        self.baseline = Baseline()
        self._turn = threading.Lock()  # waited for in the caller's thread, so turns never queue on the engine thread
        self._count_lock = threading.Lock()
        self.rounds = 0  # decoding rounds since start-up, every session together
        self.active = 0  # turns decoding or waiting for the engine

    @property
    def methods(self) -> tuple[str, ...]:
        return ("eagle", "vanilla") if self.engine.head is not None else ("vanilla",)

    def _count(self, rounds: int = 0, active: int = 0) -> None:
        with self._count_lock:
            self.rounds += rounds
            self.active += active

    def calibrate(self, tokens: int = 24) -> None:
        """Measure plain decoding on this machine: `tokens` rounds after the prefill."""
        ids = self.engine.encode_chat(CALIBRATION_PROMPT)
        params = DecodeParams(method="vanilla", max_new_tokens=tokens + 1)
        for _ in self.stream(ids, params, "start-up calibration"):
            pass

    def fit(self, messages: list[dict], max_new_tokens: int) -> tuple[list[int], int]:
        """Prompt ids for the conversation, dropping its oldest turns if they leave no room for the answer.

        Returns the ids and how many messages were dropped. Raises ContextTooLong when even the last user
        message alone does not fit.
        """
        room = min(max_new_tokens, self.engine.max_context // 4)
        system = 1 if messages and messages[0]["role"] == "system" else 0
        dropped = 0
        while True:
            kept = messages[:system] + messages[system + dropped :]
            ids = self.engine.encode_chat(kept)
            if len(ids) + room <= self.engine.max_context:
                return ids, dropped
            if len(kept) <= system + 1:
                raise ContextTooLong(
                    f"your message is {len(ids)} tokens long; this model reads at most {self.engine.max_context} "
                    f"tokens and needs room for its answer, so keep a message under "
                    f"{self.engine.max_context - room} tokens"
                )
            dropped += 2  # one user message and the answer to it

    def stream(
        self, prompt_ids: list[int], params: DecodeParams, baseline_source: str = "plain-decoding turns",
        every_s: float = 0.0,
    ) -> Iterator[tuple[Answer, TurnMeter]]:
        """Answer a prompt, yielding the first round, the last, and between them a round at most every `every_s`.

        Each update costs the page a re-render that shares the CPU with decoding, so the UI asks for a few per
        second rather than one per round. Closing the iterator stops the engine at its next update.
        """
        answer, detokenizer = Answer(), TokenText(self.engine.tokenizer)
        turn = TurnMeter(params.method)
        self._count(active=1)
        shown_at = None
        try:
            steps = self.engine.generate(prompt_ids, params)
            with self._turn, closing(steps):
                for i, step in enumerate(self.engine_thread.iterate(steps)):
                    answer.add(step.tokens, step.drafted, detokenizer)
                    turn.add(step, prefill=i == 0)
                    self._count(rounds=1)
                    if step.finish_reason:
                        answer.finish(detokenizer)
                    now = time.perf_counter()
                    if shown_at is None or step.finish_reason or now - shown_at >= every_s:
                        shown_at = now
                        yield answer, turn
        finally:
            self._count(active=-1)
            if params.method == "vanilla" and turn.tokens >= MIN_BASELINE_TOKENS:
                self.baseline.add(turn.tokens, turn.seconds, baseline_source)
