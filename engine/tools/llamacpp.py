"""llama.cpp as a peer in the benchmark (method `llama.cpp`): the same GGUF file, the same prompt token ids, the
same answer length and stop tokens, greedy, through `xllamacpp` (a prebuilt wheel of llama.cpp's server,
requirements-bench.txt).

The server runs in a child process and answers on a local port; its native /completion endpoint takes token ids
and returns token ids, so nothing is re-tokenized. In the bench's own process, merely starting it would slow the
engine's plain decoding markedly for the rest of the run (its OpenMP build and torch's share one runtime there),
so every method but llama.cpp would run slow in a run that included it. Its figures are the wall time of
each request (prefill included, as for every other method) and llama.cpp's own decode timings (prefill excluded).
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


@dataclass
class LlamaCppRun(Run):
    """A Run plus llama.cpp's own timing of its decoding steps, and how many prompt tokens it read."""

    decode_s: float = 0.0
    decoded_tokens: int = 0
    prompt_tokens: int = 0


class LlamaCpp:
    """One llama.cpp server over a GGUF file, in a child process, answering one request at a time."""

    def __init__(self, gguf: Path, threads: int, context: int, stop_ids: tuple[int, ...]):
        require(PACKAGE, "method llama.cpp", "-r requirements-bench.txt")
        self.threads, self.stop_ids = threads, stop_ids
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: none of this process's threads or torch
        self._pipe, child_end = spawn.Pipe()
        self._process = spawn.Process(target=_serve, args=(str(gguf), threads, context, child_end), daemon=True)
        self._process.start()
        child_end.close()  # the child's end lives in the child: a child that dies early then reads as EOF here
        try:
            answered = self._pipe.poll(STARTUP_S)
            kind, detail = self._pipe.recv() if answered else ("error", f"no server within {STARTUP_S} s")
        except EOFError:  # the child died before it could say why
            kind, detail = "error", "its process exited before the server was up"
        if kind == "error":
            self.close()
            raise RuntimeError(f"llama.cpp could not serve {gguf}: {detail}")
        self._url = detail + "/completion"
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: never via a proxy

    def run(self, prompt: list[int], params: DecodeParams) -> LlamaCppRun:
        """Decode `prompt`'s continuation; tokens are cut after the first stop token, which is kept, as the engine's
        are."""
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
        return LlamaCppRun(tokens, wall, len(tokens), decode_s=timings["predicted_ms"] / 1000,
                           decoded_tokens=timings["predicted_n"], prompt_tokens=timings["prompt_n"])

    def close(self) -> None:
        """Stop the server: its process ends when the pipe closes."""
        self._pipe.close()
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _serve(gguf: str, threads: int, context: int, pipe) -> None:
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
        server = xllamacpp.Server(params)
    except Exception as err:  # reported to the parent, which raises it with the file's name
        pipe.send(("error", f"{type(err).__name__}: {err}"))
        return
    pipe.send(("address", server.listening_address))
    try:
        pipe.recv()  # nothing is ever sent: returns (raising EOFError) once the parent closes its end
    except EOFError:
        pass


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
