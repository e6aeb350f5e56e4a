"""An OpenAI-compatible endpoint over the app's one ChatService. Its routes:

- POST /v1/chat/completions: answer a conversation (in the model's chat template, or as plain text for a model that
  does not chat);
- POST /v1/completions: continue a plain text prompt, for any model (the protocol's legacy completions);
- GET /v1/models: the served model ids, the base model alone (plain decoding) and base+head (EAGLE);
- GET /v1/engine: whether the model is loaded, and the engine's rounds and turns in progress.

API requests take their turn with the UI's: ChatService.stream waits for the same turn lock and decodes on the same
engine thread. A request reads that stream from worker threads, one update per call, and closes it at a stop string
or when its client has gone, which stops the engine after the round in progress.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine import DecodeParams, Engine

from .chat import APP_PARAMS, LOAD_FAILURES, Busy, ChatService, Names, first_line
from .models import HeadInfo, ModelFolders, ModelInfo, find_heads, find_models, head_fit, load_options
from .meter import TurnMeter
from .openai_schema import (
    ApiError, ChatCompletion, ChatRequest, Completion, CompletionRequest, SamplingRequest, TextCompletion, event,
    parse_request, usage,
)
from .render import Answer

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20  # far above any context this engine serves; a bigger body is refused before parsing
WAITING_REQUESTS = 16  # API requests that may block a worker thread while they wait for their turn; more wait idle
LOADING = "the model is still loading; retry in a few seconds"
SHARE_REFUSED = (
    "the API is off on a public --share link without --api-key or --auth: restart the app with one of them"
)
FINISH_REASONS = {"eos": "stop", "length": "length", "context": "length"}  # the engine's names -> the protocol's


@dataclass(frozen=True)
class Access:
    """Who may call the API: holders of a key (sent as a Bearer token), or anyone when there is none; nobody when
    the app is shared publicly without keys (`public`)."""

    keys: tuple[str, ...] = ()
    public: bool = False

    @classmethod
    def from_options(cls, api_key: str | None, auth: list[tuple[str, str]] | None, share: bool) -> Access:
        """--api-key is a key; so is each of the UI's --auth users, as "user:password"."""
        keys = tuple(k for k in (api_key, *(":".join(pair) for pair in auth or ())) if k)
        return cls(keys, share)

    def check(self, authorization: str | None) -> None:
        if not self.keys:
            if self.public:
                raise ApiError(403, SHARE_REFUSED, type="permission_error", code="api_disabled")
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>' (--api-key, or "
                           "user:password of --auth)", type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if not any(secrets.compare_digest(token.strip().encode(), key.encode()) for key in self.keys):
            raise ApiError(401, "incorrect API key", type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def warning(self, host: str | None) -> str | None:
        """What start-up should say loudly about this access, if anything."""
        if self.public and not self.keys:
            return f"--share without --api-key or --auth: {SHARE_REFUSED}"
        if not self.keys and host not in (None, "127.0.0.1", "localhost", "::1"):
            return f"the API at /v1 on {host} has no key: anyone who reaches this address can use it (--api-key)"
        return None


def conversation_ids(engine: Engine, chat: ChatRequest) -> list[int]:
    return engine.encode_chat([m.chat() for m in chat.messages])


def prompt_ids(engine: Engine, completion: CompletionRequest) -> list[int]:
    return engine.encode_text(completion.prompt)


@dataclass(frozen=True)
class Endpoint:
    """What sets the two completion routes apart; the checks, the decoding and the answer's course are shared."""

    request: type[SamplingRequest]
    encode: Callable[[Engine, Any], list[int]]  # the request's prompt as token ids; ValueError if unfit
    field: str  # the request field that holds the prompt, named when it is refused
    noun: str  # what the prompt is called in a refusal
    answer: type[Completion]


CHAT = Endpoint(ChatRequest, conversation_ids, "messages", "conversation", ChatCompletion)
TEXT = Endpoint(CompletionRequest, prompt_ids, "prompt", "prompt", TextCompletion)


@dataclass(frozen=True)
class Job:
    """A validated request, ready for the engine, and the shape its answer takes."""

    model: str
    prompt_ids: list[int]
    params: DecodeParams
    stops: tuple[str, ...]
    include_usage: bool
    answer: type[Completion]


def release(text: str, stops: tuple[str, ...], final: bool) -> tuple[int, bool]:
    """How much of the answer so far the client may see, and whether a stop string ends it there.

    A tail that could begin a stop string is held back until the next round tells, so streamed text never shows
    what a stop string would have cut.
    """
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    if found:
        return min(found), True
    if final:
        return len(text), False
    held = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return len(text) - held, False


class Reply:
    """The answer as the client sees it: the text released so far, why it ended, and the engine's figures."""

    def __init__(self, job: Job):
        self.stops, self.text, self.stopped = job.stops, "", False
        self.answer, self.meter = Answer(), TurnMeter(job.params.method)

    def update(self, answer: Answer, meter: TurnMeter) -> str:
        """Take one round's state of the answer; returns the text newly released."""
        self.answer, self.meter = answer, meter
        end, self.stopped = release(answer.text, self.stops, final=meter.finish_reason is not None)
        new, self.text = answer.text[len(self.text) : end], answer.text[:end]
        return new

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self.stopped else FINISH_REASONS.get(self.meter.finish_reason or "")

    def figures(self) -> dict:
        """The speculative decoding figures, in the extra field "eagle"."""
        tau, speed = self.meter.tau, self.meter.tokens_per_s
        return {
            "method": self.meter.method, "rounds": self.meter.rounds, "accepted_tokens": sum(self.answer.drafted),
            "tau": None if tau is None else round(tau, 3), "tokens_per_s": None if speed is None else round(speed, 2),
        }

    def timings(self, prompt_tokens: int) -> dict:
        """The answer's timings as llama.cpp's server reports them (its field "timings"), so that clients written for
        it read the drafting figures too: the prompt's forward, then the tokens decoded after it."""
        meter = self.meter  # as in llama.cpp: the prompt's forward gives a predicted token, in the prompt's time
        decoded_ms, tokens = 1000 * meter.decoding.seconds, meter.first_tokens + meter.tokens
        return {
            "prompt_n": prompt_tokens, "prompt_ms": round(1000 * meter.prefill_s, 3),
            "prompt_per_second": round(prompt_tokens / meter.prefill_s, 2) if meter.prefill_s else None,
            "predicted_n": tokens, "predicted_ms": round(decoded_ms, 3),
            "predicted_per_second": round(1000 * tokens / decoded_ms, 2) if decoded_ms else None,
            "draft_n": meter.drafted, "draft_n_accepted": meter.accepted,
        }


class Api:
    """The /v1 routes. Until a ChatService is attached (the model loads) they answer 503."""

    def __init__(
        self, access: Access, max_new_tokens: int | None = None, defaults: DecodeParams = APP_PARAMS,
        waiting: int = WAITING_REQUESTS, folders: ModelFolders | None = None,
    ):
        """max_new_tokens: the longest answer this server gives (a longer max_tokens is cut there, finish_reason
        "length"); None: as long as the model's context holds. folders: where the models a request may name are
        found (app/models.py), loaded in place of the engine's when one is asked for; None: only the loaded model."""
        self.access, self.max_new_tokens, self.defaults, self.folders = access, max_new_tokens, defaults, folders
        self.service: ChatService | None = None
        self._fixed: dict[str, str] | None = None
        self.created = int(time.time())
        self._waiting = anyio.CapacityLimiter(waiting)
        self._swapping = threading.Lock()

    def attach(self, service: ChatService, models: dict[str, str] | None = None) -> None:
        """models: the served ids and their methods, as given (a model built in memory has no file to be named by);
        None: the loaded model's names, whichever model that is."""
        self._fixed = models
        self.service = service  # last: requests take a set service for a loaded model

    @property
    def models(self) -> dict[str, str]:
        """The ids served by the loaded model and their methods: the base alone (vanilla) and base+head (eagle)."""
        if self._fixed is not None:
            return self._fixed
        return self.service.names().model_ids() if self.service is not None else {}

    def loadable(self) -> dict[str, tuple[ModelInfo, HeadInfo | None]]:
        """Every other model a request may name, to be loaded for it: each model found by id, and id+head for each
        head that fits it."""
        if self.folders is None:
            return {}
        heads, found = find_heads(self.folders), {}
        for model in find_models(self.folders):
            if model.problem is None:
                found[model.id] = (model, None)
                found |= {f"{model.id}+{head.id}": (model, head) for head in heads if head_fit(head, model) is None}
        return {name: entry for name, entry in found.items() if name not in self.models}

    def routes(self) -> list[Route]:
        """The routes, for Gradio's FastAPI app (launch's app_kwargs) or a bare Starlette app."""
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/engine", self.engine_status, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/{path:path}", self.unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        ]

    def _ready(self, request: Request) -> ChatService:
        self.access.check(request.headers.get("authorization"))
        if self.service is None:
            raise ApiError(503, LOADING, type="server_error", code="model_loading", headers={"Retry-After": "5"})
        return self.service

    async def list_models(self, request: Request) -> JSONResponse:
        return await _answer(self._models(request))

    async def _models(self, request: Request) -> dict:
        """The loaded model's ids ("loaded": true), then those a request may name to have them loaded."""
        self._ready(request)
        loadable = await anyio.to_thread.run_sync(self.loadable)
        entries = [(name, method, True) for name, method in self.models.items()]
        entries += [(name, "eagle" if head else "vanilla", False) for name, (_, head) in loadable.items()]
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "eagle-chat", "method": method,
                 "loaded": loaded} for name, method, loaded in entries]
        return {"object": "list", "data": data}

    async def engine_status(self, request: Request) -> JSONResponse:
        """Whether the model is loaded, and the engine's rounds since start-up and turns in progress, UI's included."""
        return await _answer(self._engine_status(request))

    async def _engine_status(self, request: Request) -> dict:
        self.access.check(request.headers.get("authorization"))
        service = self.service
        return {"object": "engine", "ready": service is not None, "rounds": service.rounds if service else 0,
                "active": service.active if service else 0}

    async def unknown(self, request: Request) -> JSONResponse:
        return _error(ApiError(404, f"no route {request.method} {request.url.path} on this server", code="unknown_url"))

    async def chat_completions(self, request: Request) -> JSONResponse | StreamingResponse:
        return await self._complete(request, CHAT)

    async def completions(self, request: Request) -> JSONResponse | StreamingResponse:
        """Plain text continued, for every model, chatting or not, as OpenAI-compatible servers do."""
        return await self._complete(request, TEXT)

    async def _complete(self, request: Request, endpoint: Endpoint) -> JSONResponse | StreamingResponse:
        try:
            service = self._ready(request)
            asked = parse_request(await _body(request), endpoint.request)
            job = await anyio.to_thread.run_sync(self._job, service, endpoint, asked, limiter=self._waiting)
        except ApiError as err:
            return _error(err)
        if asked.stream:
            return StreamingResponse(self._events(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _answer(self._whole(job, request))

    def _job(self, service: ChatService, endpoint: Endpoint, asked: SamplingRequest) -> Job:
        """Check the request against the engine: the model id (another model found here is loaded first), the
        prompt and how long an answer fits."""
        if asked.model not in self.models:
            self._load(service, asked.model)
        try:
            ids = endpoint.encode(service.engine, asked)
        except ValueError as err:
            raise ApiError(400, str(err), param=endpoint.field, code="invalid_value") from None
        room = self._room(service.engine, ids, endpoint)
        params = self.defaults.with_options(
            method=self.models[asked.model], max_new_tokens=min(asked.limit or room, self.max_new_tokens or room, room),
            temperature=asked.temperature, top_p=asked.top_p, top_k=asked.top_k, seed=asked.seed,
        )
        return Job(asked.model, ids, params, asked.stop, asked.stream_options.include_usage, endpoint.answer)

    def _load(self, service: ChatService, name: str) -> None:
        """Load the model a request names in place of the engine's, as the page's Models tab does; 404 with the ids
        there are for one not found, 503 while an answer streams, 500 for a load that failed (the engine then
        answers as before)."""
        with self._swapping:  # requests for the same new model load it once
            if name in self.models:
                return
            found = self.loadable()
            if name not in found:
                choices = ", ".join([*self.models, *found])
                raise ApiError(404, f"model {name!r} is not served here; choose one of {choices}", param="model",
                               code="model_not_found")
            model, head = found[name]
            try:
                service.swap(load_options(service.options, model, head), Names(model.id, head and head.id))
            except Busy as err:
                raise ApiError(503, f"model {name!r} is not loaded yet: {err}", type="server_error",
                               code="model_busy", headers={"Retry-After": "5"}) from None
            except LOAD_FAILURES as err:
                log.warning("loading %s failed: %s", model.path, err)
                raise ApiError(500, f"model {name!r} could not be loaded ({first_line(err)}); the model before "
                               "keeps answering", type="server_error", code="model_load_failed") from None

    @staticmethod
    def _room(engine: Engine, ids: list[int], endpoint: Endpoint) -> int:
        """How many tokens an answer may take: what the context holds after the prompt. A longer max_tokens is cut
        there (finish_reason "length"); only a prompt that leaves no room at all is refused."""
        room = engine.max_context - len(ids)
        if room < 1:
            raise ApiError(400, f"the {endpoint.noun} is {len(ids)} tokens long: this model's context of "
                           f"{engine.max_context} tokens leaves no room for an answer", param=endpoint.field,
                           code="context_length_exceeded")
        return room

    async def _rounds(self, job: Job, reply: Reply, request: Request | None = None) -> AsyncIterator[str]:
        """Decode `job`, yielding the text each round releases; stops the engine at a stop string, or when the
        client of a non-streaming `request` has gone (a streaming response is cancelled by the server instead)."""
        stream = self.service.stream(job.prompt_ids, job.params)
        limiter = self._waiting  # the first round waits for the turn; the turn's holder never queues behind waiters
        try:
            while (update := await anyio.to_thread.run_sync(next, stream, None, limiter=limiter)) is not None:
                limiter = None
                yield reply.update(*update)
                if reply.stopped or (request is not None and await request.is_disconnected()):
                    return
        finally:  # closing ends the turn and lets go of the engine, even while the response is being cancelled
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stream.close)

    async def _whole(self, job: Job, request: Request) -> dict:
        reply = Reply(job)
        async for _ in self._rounds(job, reply, request):
            pass
        completion = job.answer(job.model)
        return completion.whole(reply.text, reply.finish_reason or "length", self._usage(job, reply),
                                eagle=reply.figures(), timings=reply.timings(len(job.prompt_ids)))

    async def _events(self, job: Job) -> AsyncIterator[str]:
        completion, reply = job.answer(job.model), Reply(job)
        for chunk in completion.opening():
            yield event(chunk)
        try:
            async for text in self._rounds(job, reply):
                if text:
                    yield event(completion.piece(text))
            yield event(completion.closing(reply.finish_reason or "length", eagle=reply.figures(),
                                           timings=reply.timings(len(job.prompt_ids))))
            if job.include_usage:
                yield event(completion.usage_chunk(self._usage(job, reply)))
        except Exception as err:  # the status line has gone out: the client hears of a failure in the stream
            log.exception("streamed completion failed")
            yield event(_server_error(err).body())
        yield event("[DONE]")

    @staticmethod
    def _usage(job: Job, reply: Reply) -> dict:
        """Completion tokens count every token decoded, those a stop string cut from the text included."""
        return usage(len(job.prompt_ids), len(reply.answer.ids))


async def _body(request: Request) -> bytes:
    """The request body, refused with 413 past MAX_BODY_BYTES without reading the rest."""
    too_big = ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", code="request_too_large")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise too_big
    return bytes(body)


async def _answer(body: Awaitable[dict]) -> JSONResponse:
    """The JSON `body` resolves to, or its ApiError in the protocol's shape, or any other failure as a 500."""
    try:
        return JSONResponse(await body)
    except ApiError as err:
        return _error(err)
    except Exception as err:  # never a traceback to the client; the log has it
        log.exception("API request failed")
        return _error(_server_error(err))


def _server_error(err: Exception) -> ApiError:
    return ApiError(500, f"the server failed while answering ({type(err).__name__}); its log has the details",
                    type="server_error", code="internal_error")


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def serve(api: Api, host: str | None, port: int | None, load: Callable[[], None]) -> None:
    """The API alone, without the UI: serve at once (503 until the model is ready) while `load` attaches it."""
    server = uvicorn.Server(uvicorn.Config(
        Starlette(routes=api.routes()),
        host=host or "127.0.0.1", port=port or 7860, log_level="info",
    ))
    failure: list[BaseException] = []

    def load_then_stop_on_failure() -> None:
        try:
            load()
        except BaseException as err:  # the main thread reports it once the server has stopped
            failure.append(err)
            server.should_exit = True

    threading.Thread(target=load_then_stop_on_failure, name="load", daemon=True).start()
    server.run()
    if failure:
        raise failure[0]
