"""The OpenAI protocol's shapes for chat completions and (legacy) text completions: the requests this server accepts,
and the JSON it answers with.

A field the engine cannot honour is refused by name rather than ignored, so a client never gets an answer that
quietly differs from what it asked for. No engine and no web framework here: app/api.py joins the two.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOPS = 4  # the protocol's limit on stop strings
# Protocol fields the engine cannot honour: refused unless they hold their neutral value.
_SAMPLING_UNSUPPORTED = ("logprobs", "logit_bias", "presence_penalty", "frequency_penalty")
UNSUPPORTED = _SAMPLING_UNSUPPORTED + (
    "tools", "functions", "top_logprobs", "response_format", "audio", "prediction", "modalities",
)
COMPLETION_UNSUPPORTED = _SAMPLING_UNSUPPORTED + ("echo", "suffix")
_NEUTRAL = (None, False, 0, [], {}, {"type": "text"}, ["text"])
# Protocol fields that describe the caller or storage, or only matter with tools: accepted and ignored.
IGNORED = ("user", "metadata", "store", "service_tier", "tool_choice", "parallel_tool_calls")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """A request that cannot be answered, with the protocol's error fields and the HTTP status it maps to."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _text(content: Any) -> str:
    """A message's content as one string: a string, or a list of text parts (the protocol's other shape)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"only text parts are supported, not {kind or type(part).__name__!r}")
        texts.append(part["text"])
    return "".join(texts)


class Message(BaseModel):
    """One conversation message; "developer" (the protocol's newer name for system) counts as system."""

    model_config = ConfigDict(strict=True, extra="ignore")  # "name" and the like do not reach the chat template
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, content: Any) -> str:
        return _text(content)

    def chat(self) -> dict[str, str]:
        return {"role": _ROLES[self.role], "content": self.content}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both completion requests share and the engine honours; null means absent, as in the protocol."""

    model_config = ConfigDict(strict=True, extra="ignore")  # every other field was screened by check_fields
    unsupported: ClassVar[tuple[str, ...]] = _SAMPLING_UNSUPPORTED  # the protocol's fields refused unless neutral
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # not in the protocol; llama.cpp's and vLLM's servers take it too
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions = Field(default_factory=StreamOptions)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, stop: Any) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        return tuple(stops)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported (one choice per request), got {n}")
        return n

    @property
    def limit(self) -> int | None:
        """The longest answer asked for, if any."""
        return self.max_tokens


class ChatRequest(SamplingRequest):
    """A chat-completions request: a conversation to answer."""

    unsupported: ClassVar[tuple[str, ...]] = UNSUPPORTED
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_length(self) -> ChatRequest:
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise ValueError("max_tokens and max_completion_tokens differ: give one of them")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingRequest):
    """A (legacy) completions request: one plain text prompt to continue."""

    unsupported: ClassVar[tuple[str, ...]] = COMPLETION_UNSUPPORTED
    prompt: str
    best_of: int = 1

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """The protocol also takes a list of prompts, or token ids; one text prompt is what the engine answers."""
        if not isinstance(prompt, list):
            return prompt
        if not all(isinstance(p, str) for p in prompt):
            raise ValueError("token-id prompts are not supported: send the prompt as a string")
        if len(prompt) != 1:
            raise ValueError(f"only one prompt per request is supported, got {len(prompt)}")
        return prompt[0]

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, best_of: int) -> int:
        if best_of != 1:
            raise ValueError(f"only best_of=1 is supported (one candidate per request), got {best_of}")
        return best_of


def check_fields(body: Any, kind: type[SamplingRequest] = ChatRequest) -> None:
    """Refuse a body that is not an object, or holds a field the engine cannot honour or this server does not know."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    known = set(kind.model_fields) | set(IGNORED)
    for name, value in body.items():
        if name in kind.unsupported and value not in _NEUTRAL:
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        if name not in known and name not in kind.unsupported:
            raise ApiError(400, f"unrecognized request field {name!r}", param=name, code="unknown_parameter")


def parse_request(raw: bytes, kind: type[SamplingRequest] = ChatRequest) -> SamplingRequest:
    """The request of `kind` in a body, or an ApiError that names the offending field."""
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    check_fields(body, kind)
    try:
        return kind.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value") from None


class Completion:
    """The id and creation time one answer's JSON objects share, and the objects themselves. A subclass names them
    and says how a choice holds the text: both routes stream and finish alike."""

    prefix: ClassVar[str]  # of the id
    whole_kind: ClassVar[str]  # the "object" of the non-streaming answer
    chunk_kind: ClassVar[str]  # the "object" of a streamed chunk

    def __init__(self, model: str):
        self.id, self.model, self.created = f"{self.prefix}-{uuid.uuid4().hex}", model, int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    @staticmethod
    def _choice(content: dict, finish_reason: str | None) -> dict:
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}

    def _in_whole(self, text: str) -> dict:
        """The whole answer's text, as its choice holds it."""
        raise NotImplementedError

    def _in_chunk(self, text: str | None) -> dict:
        """A streamed piece of text (None: the closing chunk's), as its choice holds it."""
        raise NotImplementedError

    def whole(self, text: str, finish_reason: str, usage: dict, **extra: Any) -> dict:
        """The non-streaming answer."""
        return self._object(self.whole_kind, [self._choice(self._in_whole(text), finish_reason)], usage=usage, **extra)

    def opening(self) -> list[dict]:
        """The chunks a stream opens with, before any text."""
        return []

    def piece(self, text: str) -> dict:
        """One streamed piece of the answer."""
        return self._object(self.chunk_kind, [self._choice(self._in_chunk(text), None)])

    def closing(self, finish_reason: str, **extra: Any) -> dict:
        """The chunk that ends the answer's text, saying why."""
        return self._object(self.chunk_kind, [self._choice(self._in_chunk(None), finish_reason)], **extra)

    def usage_chunk(self, usage: dict) -> dict:
        """The stream's last chunk when the client asked for usage (stream_options.include_usage): no choices."""
        return self._object(self.chunk_kind, [], usage=usage)


class ChatCompletion(Completion):
    """A chat answer: the assistant's message, streamed as deltas after one that gives the role."""

    prefix, whole_kind, chunk_kind = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _in_whole(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _in_chunk(self, text: str | None) -> dict:
        return {"delta": {} if text is None else {"content": text}}

    def opening(self) -> list[dict]:
        return [self._object(self.chunk_kind, [self._choice({"delta": {"role": "assistant", "content": ""}}, None)])]


class TextCompletion(Completion):
    """A text completion: the continuation as plain text, streamed as objects of the same kind."""

    prefix, whole_kind, chunk_kind = "cmpl", "text_completion", "text_completion"

    def _in_whole(self, text: str) -> dict:
        return {"text": text}

    def _in_chunk(self, text: str | None) -> dict:
        return {"text": text or ""}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def event(data: dict | str) -> str:
    """One server-sent event carrying a JSON object (or the stream's closing [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
