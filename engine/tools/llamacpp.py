"""llama.cpp as a peer in the benchmark (method `llama.cpp`): the same GGUF file, the same prompt token ids, the
same answer length and stop tokens, greedy, through `xllamacpp` (a prebuilt wheel of llama.cpp's server,
requirements-bench.txt).

The server runs in a child process and answers on a local port; its native /completion endpoint takes token ids
and returns token ids, so nothing is re-tokenized. In the bench's own process, merely starting it would slow the
engine's plain decoding markedly for the rest of the run (its OpenMP build and torch's share one runtime there),
so every method but llama.cpp would run slow in a run that included it. Its figures are the wall time of
each request (prefill included, as for every other method) and llama.cpp's own decode timings (prefill excluded).

Method `llama.cpp-eagle3` is the same server with llama.cpp's own EAGLE-3 speculative decoding, the draft head
exported to its GGUF layout (engine/draft/export_gguf.py). llama.cpp reports how many tokens the head drafted and
how many the target accepted (draft_n, draft_n_accepted in each answer's timings): acceptance is their ratio.
"""
from __future__ import annotations

import importlib
import json
import multiprocessing
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..model.load import require
from ..decode.params import DecodeParams
from .runs import Run

PACKAGE = "xllamacpp"
STARTUP_S = 120  # loading the model, on a busy 2-core machine
EAGLE3_METHOD = "llama.cpp-eagle3"


@dataclass
class LlamaCppRun(Run):
    """A Run plus llama.cpp's own timing of its decoding steps, and how many prompt tokens it read."""

    decode_s: float = 0.0
    decoded_tokens: int = 0
    prompt_tokens: int = 0
    drafted: int = 0  # tokens the draft head proposed (llama.cpp's draft_n)
    accepted: int = 0  # of those, the ones the target kept (draft_n_accepted)


@dataclass(frozen=True)
class Eagle3Draft:
    """llama.cpp's EAGLE-3 speculative decoding: the head's GGUF and how many tokens it drafts per round. p_min 0
    drafts all n_max tokens every round, as a chain: acceptance is then the head's agreement with the target, not
    a confidence filter's."""

    gguf: Path
    n_max: int = 1
    p_min: float = 0.0


class LlamaCpp:
    """One llama.cpp server over a GGUF file, in a child process, answering one request at a time."""

    def __init__(self, gguf: Path, threads: int, context: int, stop_ids: tuple[int, ...],
                 draft: Eagle3Draft | None = None):
        require(PACKAGE, "method llama.cpp", "-r requirements-bench.txt")
        self.threads, self.stop_ids = threads, stop_ids
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: none of this process's threads or torch
        self._pipe, child_end = spawn.Pipe()
        self._process = spawn.Process(target=_serve, args=(str(gguf), threads, context, draft, child_end),
                                      daemon=True)
        self._process.start()
        child_end.close()  # the child's end lives in the child: a child that dies early then reads as EOF here
        try:
            answered = self._pipe.poll(STARTUP_S)
            kind, detail = self._pipe.recv() if answered else ("error", f"no server within {STARTUP_S} s")
        except EOFError:  # the child died before it could say why
            kind, detail = "error", "its process exited before the server was up"
        if kind == "error":
            self.close()
            with_draft = f" with the EAGLE-3 draft {draft.gguf}" if draft else ""
            raise RuntimeError(f"llama.cpp could not serve {gguf}{with_draft}: {detail}")
        self._url = detail + "/completion"
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: never via a proxy

    def run(self, prompt: list[int], params: DecodeParams) -> LlamaCppRun:
        """Decode `prompt`'s continuation; tokens are cut after the first stop token, which is kept, as the engine's
        are. With a draft, target_forwards counts the prefill and one forward per round: every round ends with the
        target's own token after the drafts it accepted, so rounds = tokens - 1 - accepted."""
        request = {"prompt": prompt, "n_predict": params.max_new_tokens, "cache_prompt": False,
                   "return_tokens": True, **_sampling(params)}
        body = urllib.request.Request(self._url, data=json.dumps(request).encode(),
                                      headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with self._opener.open(body) as response:
            answer = json.loads(response.read())
        wall = time.perf_counter() - start
        tokens = answer["tokens"][: params.max_new_tokens]
        stop = next((i for i, token in enumerate(tokens) if token in self.stop_ids), None)
        tokens = tokens if stop is None else tokens[: stop + 1]
        timings = answer["timings"]
        drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
        return LlamaCppRun(tokens, wall, max(1, len(tokens) - accepted), decode_s=timings["predicted_ms"] / 1000,
                           decoded_tokens=timings["predicted_n"], prompt_tokens=timings["prompt_n"],
                           drafted=drafted, accepted=accepted)

    def close(self) -> None:
        """Stop the server: its process ends when the pipe closes."""
        self._pipe.close()
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _serve(gguf: str, threads: int, context: int, draft: Eagle3Draft | None, pipe) -> None:
    """The child process: start the server, send its address (or why it failed), serve until the pipe closes."""
    try:
        xllamacpp = importlib.import_module(PACKAGE)
        params = xllamacpp.CommonParams()
        params.model.path = gguf
        params.n_ctx = context
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
        params.n_parallel = 1
        params.warmup = False
        params.verbosity = -1
        if draft is not None:
            _add_eagle3(xllamacpp, params, draft, threads)
        server = xllamacpp.Server(params)
    except Exception as err:  # reported to the parent, which raises it with the file's name
        pipe.send(("error", f"{type(err).__name__}: {err}"))
        return
    pipe.send(("address", server.listening_address))
    try:
        pipe.recv()  # nothing is ever sent: returns (raising EOFError) once the parent closes its end
    except EOFError:
        pass


def _add_eagle3(xllamacpp, params, draft: Eagle3Draft, threads: int) -> None:
    """Turn on llama.cpp's EAGLE-3 speculative decoding with `draft`, its draft context on the target's threads."""
    spec = params.speculative
    spec.types = [xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3]
    spec.draft.mparams.path = str(draft.gguf)
    spec.draft.n_max, spec.draft.n_min, spec.draft.p_min = draft.n_max, 0, draft.p_min
    spec.draft.cpuparams.n_threads = spec.draft.cpuparams_batch.n_threads = threads


def _sampling(params: DecodeParams) -> dict:
    """llama.cpp's sampler chain for params: the argmax when greedy, else top-k, top-p and temperature with a seed."""
    sampling = params.sampling
    if sampling.greedy:
        return {"samplers": ["top_k"], "top_k": 1, "temperature": 0.0}
    options = {"samplers": ["top_k", "top_p", "temperature"], "top_k": sampling.top_k, "top_p": sampling.top_p,
               "temperature": sampling.temperature}
    return options if params.seed is None else options | {"seed": params.seed}


def decode_tokens_per_s(runs: list[LlamaCppRun]) -> float | None:
    """Tokens per second of llama.cpp's decoding steps over all runs, by its own clock."""
    seconds = sum(r.decode_s for r in runs)
    return sum(r.decoded_tokens for r in runs) / seconds if seconds else None


def eagle3_summary(runs: list[LlamaCppRun], plain: list[LlamaCppRun] | None, n_max: int) -> dict:
    """llama.cpp-eagle3's own figures: drafted and accepted tokens, their ratio, and on how many questions its
    greedy tokens equal plain llama.cpp's (the lossless check that fits it: both round as llama.cpp does)."""
    drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
    return {
        "decode_tokens_per_s": decode_tokens_per_s(runs),
        "draft_max": n_max,
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "matches_llama_cpp": (sum(r.token_ids == p.token_ids for r, p in zip(runs, plain))
                              if plain is not None else None),
    }


def eagle3_notes(summary: dict, questions: int) -> list[str]:
    """The lines under the bench's table for llama.cpp-eagle3: acceptance, and a WARNING where its greedy tokens
    differ from plain llama.cpp's."""
    acceptance = "-" if summary["acceptance"] is None else f"{summary['acceptance']:.3f}"
    notes = [f"note: {EAGLE3_METHOD} drafts up to {summary['draft_max']} token(s) a round: llama.cpp accepted "
             f"{summary['draft_n_accepted']}/{summary['draft_n']} drafted tokens (acceptance {acceptance}), "
             f"tau {summary['tau']:.2f}"]
    matches = summary["matches_llama_cpp"]
    if matches is not None:
        line = f"its greedy tokens equal plain llama.cpp's on {matches}/{questions} questions"
        notes.append(f"note: {line}" if matches == questions else f"WARNING: {line} (expected all at temperature 0)")
    return notes
