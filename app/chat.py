"""The one engine every browser session shares: a chat turn as a stream of (answer, meter) updates.

No Gradio here: the UI turns these updates into HTML, and tests drive the service directly.
"""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from engine import CheckpointError, ContextTooLong, DecodeParams, Engine, LoadOptions, Step, freeze_heap, oldest_turns_dropped
from engine.draft.checkpoint import DEFAULT_HEAD
from engine.model.load import DEFAULT_BASE

from .meter import TurnMeter, turn_log_line
from .render import Answer, TokenText

log = logging.getLogger(__name__)
T = TypeVar("T")
# The app's decoding defaults, for the page's settings and the API alike: EAGLE with its head gate on (engine.decode.gate)
APP_PARAMS = DecodeParams(gate=True)


class Decoding:
    """A generation running ahead on the engine thread: no decoding step ever waits for the page. The caller
    takes whatever steps have arrived, at its own pace; cancel() stops the engine after the step in progress."""

    def __init__(self, executor: ThreadPoolExecutor, steps: Iterator[Step], on_step: Callable[[], None]):
        self._arrived: list[Step] = []
        self._done, self._error = False, None
        self._changed = threading.Condition()
        self._cancelled = threading.Event()
        self._future: Future = executor.submit(self._run, steps, on_step)

    def _run(self, steps: Iterator[Step], on_step: Callable[[], None]) -> None:
        try:
            with closing(steps):
                for step in steps:
                    on_step()
                    with self._changed:
                        self._arrived.append(step)
                        self._changed.notify()
                    if self._cancelled.is_set():
                        return
        except BaseException as err:  # handed to the caller, which reports it
            self._error = err
        finally:
            with self._changed:
                self._done = True
                self._changed.notify()

    def take(self, not_before: float) -> tuple[list[Step], bool]:
        """The steps that arrived since the last take, waiting at least until `not_before` (perf_counter time)
        unless decoding ends first, then for at least one step. Returns them and whether decoding has ended."""
        with self._changed:
            self._changed.wait_for(lambda: self._done, timeout=max(0.0, not_before - time.perf_counter()))
            self._changed.wait_for(lambda: self._arrived or self._done)
            steps, self._arrived = self._arrived, []
            if self._error is not None:
                raise self._error
            return steps, self._done and not self._arrived

    def cancel(self) -> None:
        """Stop after the step in progress and wait for the engine to let go (one round at most)."""
        self._cancelled.set()
        self._future.result()


class EngineThread:
    """One long-lived thread for every engine call of the app, the model load included.

    Why: each thread that runs torch CPU work gets its own OpenMP team. Gradio calls a generator's steps from
    any of its worker threads, and once a second team exists on a 2-core machine decoding runs at little more than
    half its speed, in the app as in a bare script.
    """

    def __init__(self) -> None:
        self._start()
        os.register_at_fork(after_in_child=self._start)  # ZeroGPU runs the stream in a forked process

    def _start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._executor.submit(function, *args, **kwargs).result()

    def decode(self, steps: Iterator[Step], on_step: Callable[[], None]) -> Decoding:
        """Run `steps` to the end on the engine thread, ahead of whoever reads them."""
        return Decoding(self._executor, steps, on_step)


@dataclass(frozen=True)
class Names:
    """The loaded base model and head as the page and the API name them."""

    base: str
    head: str | None

    def model_ids(self) -> dict[str, str]:
        """The served model ids and their methods: the base model alone (plain decoding), and base+head (EAGLE)."""
        ids = {self.base: "vanilla"}
        if self.head is not None:
            ids[f"{self.base}+{self.head}"] = "eagle"
        return ids


def model_name(source: str | Path) -> str:
    """A model's id part: a folder or file by its name, a hub id as it is."""
    path = Path(source).expanduser()
    return path.name if path.exists() else str(source)


# What a failed load raises: a head that does not fit, a damaged file, a missing package, too little memory
LOAD_FAILURES = (CheckpointError, ValueError, OSError, ImportError, MemoryError, RuntimeError)


def first_line(err: BaseException) -> str:
    """An error in one line, for a user: the first line of its message."""
    return (str(err).splitlines() or [type(err).__name__])[0]


class Busy(RuntimeError):
    """The engine cannot be swapped now: an answer is streaming."""


class ModelChanged(ValueError):
    """A turn waited while another model was loaded: its prompt was encoded for the one before."""


class ChatService:
    """Chat turns over one engine, with counters shown to every session; the engine can be swapped between turns."""

    def __init__(self, engine: Engine, engine_thread: EngineThread | None = None, options: LoadOptions | None = None):
        """options: what the engine was loaded from (LoadOptions()'s defaults if not given), the starting point of a
        swap: another model keeps the device, kernels and other settings the app started with."""
        self.engine = engine
        self.options = options or LoadOptions()
        self._names: Names | None = None
        self.engine_thread = engine_thread or EngineThread()
        self._turn = threading.Lock()  # waited for in the caller's thread, so turns never queue on the engine thread
        self._count_lock = threading.Lock()
        self.rounds = 0  # decoding rounds since start-up, every session together
        self.active = 0  # turns decoding or waiting for the engine

    def names(self) -> Names:
        """The loaded model's names: as the swap named them, else from what it was loaded from (an embedded base by
        its short name)."""
        if self._names is not None:
            return self._names
        head = self.options.head if self.engine.head is not None else None
        return Names(model_name(self.options.base or DEFAULT_BASE),
                     None if head is None else model_name(DEFAULT_HEAD if head == "default" else head))

    @property
    def methods(self) -> tuple[str, ...]:
        return ("eagle", "suffix", "vanilla") if self.engine.head is not None else ("vanilla", "suffix")

    def _count(self, rounds: int = 0, active: int = 0) -> None:
        with self._count_lock:
            self.rounds += rounds
            self.active += active

    def fit(self, messages: list[dict], max_new_tokens: int) -> tuple[list[int], int]:
        """Prompt ids for the conversation, dropping its oldest turns if they leave no room for the answer.

        Returns the ids and how many messages were dropped. Raises ContextTooLong when even the last user
        message alone does not fit.
        """
        room = min(max_new_tokens, self.engine.max_context // 4)
        for kept, dropped in oldest_turns_dropped(messages):
            ids = self.engine.encode_chat(kept)
            if len(ids) + room <= self.engine.max_context:
                return ids, dropped
        raise ContextTooLong(
            f"your message is {len(ids)} tokens long; this model reads at most {self.engine.max_context} "
            f"tokens and needs room for its answer, so keep a message under {self.engine.max_context - room} tokens"
        )

    def swap(self, options: LoadOptions, names: Names | None = None) -> Engine:
        """Load the engine `options` name (on the engine thread) and answer on it from the next turn. Refused with Busy
        while an answer streams; a load that fails raises and leaves the engine in place, answering as before.
        names: what the page and the API call the new model (default: its file's and its head's folder's names)."""
        if not self._turn.acquire(blocking=False):
            raise Busy("an answer is being written: wait for it to finish (or press Stop), then load the model")
        try:
            engine = self.engine_thread.call(Engine.from_options, options)
            old, self.engine, self.options, self._names = self.engine, engine, options, names
        finally:
            self._turn.release()
        del old
        _collect_swapped_out()
        return engine

    def stream(self, prompt_ids: list[int], params: DecodeParams, every_s: float = 0.0,
               encoded_by: Engine | None = None) -> Iterator[tuple[Answer, TurnMeter]]:
        """Answer a prompt, yielding the first round, the last, and between them the latest state at most every
        `every_s`. Decoding runs ahead on the engine thread meanwhile. Closing the iterator stops the engine after
        the round in progress. encoded_by: the engine whose tokenizer made `prompt_ids`; if another model was loaded
        while the turn waited, it raises ModelChanged rather than feed one model's ids to another."""
        engine = encoded_by or self.engine
        answer, detokenizer, turn = Answer(), TokenText(engine.tokenizer), TurnMeter(params.method)
        self._count(active=1)
        try:
            with self._turn:
                if engine is not self.engine:
                    raise ModelChanged("another model was loaded while this message waited for its turn: send it "
                                       "again to have the new model answer it")
                steps = engine.generate(prompt_ids, params)
                decoding = self.engine_thread.decode(steps, on_step=lambda: self._count(rounds=1))
                try:
                    shown_at, done = None, False
                    while not done:
                        arrived, done = decoding.take(not_before=shown_at + every_s if shown_at else 0.0)
                        if arrived:  # the last step may have been taken before decoding was seen to end
                            self._add(arrived, answer, detokenizer, turn)
                            shown_at = time.perf_counter()
                            yield answer, turn
                finally:
                    decoding.cancel()
        finally:
            self._count(active=-1)
            if turn.rounds:
                log.info(turn_log_line(turn))

    @staticmethod
    def _add(steps: list[Step], answer: Answer, detokenizer: TokenText, turn: TurnMeter) -> None:
        for step in steps:
            answer.add(step.tokens, step.drafted, detokenizer, step.from_context)
            turn.add(step)
            if step.finish_reason:
                answer.finish(detokenizer)


def _collect_swapped_out() -> None:
    """Free a swapped-out engine's memory. Its objects were frozen out of the collector's sight at start-up
    (engine.freeze_heap), where its cyclic garbage would stay for the process's life: thaw, collect, freeze again."""
    gc.unfreeze()
    freeze_heap()
