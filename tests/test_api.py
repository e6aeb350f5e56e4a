"""The OpenAI-compatible endpoint of the real app (`python app.py`: embedded SmolLM2 + the shipped EAGLE-3 head),
driven by the official `openai` client; answers are checked against this process's own engine on the same model."""
from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.testclient import TestClient

from app.api import MAX_BODY_BYTES, Access, Api, release
from app.chat import ChatService
from engine import DecodeParams, Engine
from engine.draft.checkpoint import DEFAULT_HEAD
from app.process import free_port, start_app, stop_app

openai = pytest.importorskip("openai", reason="pip install -r requirements-dev.txt")

SHORT = 16  # tokens per answer, to keep the tests quick
LONG = 256  # the server's --max-new-tokens: an answer nobody stops runs this long
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
KEY = "test-key-0123"


def engine_status(url: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/v1/engine", headers=headers, timeout=30).json()


def start_server(*args: str, log: Path, key: str | None = None) -> tuple[subprocess.Popen, str]:
    """`python app.py *args`, once its engine says it is ready (--api-only serves before the model is loaded)."""
    def ready(url: str) -> bool:
        try:
            return engine_status(url.rstrip("/"), key).get("ready", False)
        except httpx.TransportError:
            return False

    process, url = start_app(*args, log=log, ready=ready)
    return process, url.rstrip("/")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[subprocess.Popen, str]:
    """The app as users start it, UI and API on one port: its process and its URL."""
    assert DEFAULT_HEAD.is_dir(), f"the shipped head {DEFAULT_HEAD} is missing: the default app has no EAGLE"
    folder = tmp_path_factory.mktemp("api")
    process, url = start_server("--max-new-tokens", str(LONG), "--data-dir", str(folder), log=folder / "app.log")
    yield process, url
    stop_app(process)


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def engine():
    """The same model in this process: what the server must answer."""
    return Engine.load()


@pytest.fixture(scope="module")
def ids(client) -> dict[str, str]:
    """Served model ids by method (the loaded model's; others found on the machine are listed after them)."""
    return {model.model_extra["method"]: model.id for model in client.models.list() if model.model_extra["loaded"]}


def expected(engine: Engine, messages: list[dict], tokens: int, **options) -> str:
    return engine.chat_text(messages, DecodeParams(method="eagle", max_new_tokens=tokens), **options)


def wakeups(pid: int) -> int:
    """Times the threads of process `pid` went to sleep and were woken since they started (Linux /proc)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        total += int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return total


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts wake-ups in Linux /proc")
def test_an_idle_server_leaves_the_cores_to_the_decoder(served):
    """Each wake-up of a server thread takes the GIL and a core from the decoder's threads for a moment; Gradio's
    queue alone used to poll a thousand times a second, answers or not (app.ui.poll_queue_gently)."""
    process, url = served
    deadline = time.monotonic() + 60
    while engine_status(url)["active"] and time.monotonic() < deadline:  # an earlier test's answer winding down
        time.sleep(0.5)
    before, start = wakeups(process.pid), time.monotonic()
    time.sleep(3)
    per_s = (wakeups(process.pid) - before) / (time.monotonic() - start)
    assert per_s < 200, f"the idle app's threads woke {per_s:.0f} times a second"


def test_models_name_the_base_model_and_head_beside_the_ui(server, ids):
    assert ids == {"vanilla": "smollm2", "eagle": f"smollm2+{DEFAULT_HEAD.name}"}
    assert "<gradio-app" in httpx.get(server + "/", timeout=30).text  # the UI is served on the same port


def test_greedy_answer_streamed_or_whole_is_the_engines_own(client, engine, ids):
    want = expected(engine, POEM, SHORT)
    whole = client.chat.completions.create(model=ids["eagle"], messages=POEM, max_tokens=SHORT, temperature=0)
    chunks = list(client.chat.completions.create(
        model=ids["eagle"], messages=POEM, max_completion_tokens=SHORT, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == want and streamed == want
    assert whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    prompt_tokens = len(engine.encode_chat(POEM))
    for used in (whole.usage, chunks[-1].usage):
        assert (used.prompt_tokens, used.completion_tokens, used.total_tokens) == (
            prompt_tokens, SHORT, prompt_tokens + SHORT)
    figures = whole.model_extra["eagle"]
    assert figures["method"] == "eagle" and figures["accepted_tokens"] > 0 and figures["tau"] > 1, figures
    assert figures["tokens_per_s"] > 0 and figures["rounds"] < SHORT  # drafts accepted: fewer rounds than tokens
    for answer in (figures, chunks[-2].model_extra["eagle"]):  # the head gate may draft the two differently
        # a round commits its accepted drafts and one token of the base model's, but the last may be cut before it
        assert answer["method"] == "eagle" and SHORT - 1 - answer["rounds"] - answer["accepted_tokens"] in (0, -1)
    for timings, answer in ((whole.model_extra["timings"], figures),
                            (chunks[-2].model_extra["timings"], chunks[-2].model_extra["eagle"])):
        assert timings["prompt_n"] == prompt_tokens and timings["predicted_n"] == SHORT, timings
        assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
        assert timings["draft_n_accepted"] == answer["accepted_tokens"] <= timings["draft_n"], (timings, answer)


def test_sampling_follows_temperature_top_p_and_seed(client, engine, ids):
    options = dict(temperature=0.8, top_p=0.9, seed=7)
    answer = client.chat.completions.create(model=ids["eagle"], messages=POEM, max_tokens=SHORT, **options)
    assert answer.choices[0].message.content == expected(engine, POEM, SHORT, **options)


def test_a_stop_string_cuts_the_answer_and_ends_decoding(client, engine, ids):
    want = expected(engine, POEM, SHORT)
    stop = want.split()[2]
    cut = want[: want.index(stop)]
    request = dict(model=ids["eagle"], messages=POEM, max_tokens=SHORT, temperature=0, stop=[stop, "§never§"])
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < SHORT, "decoding went on past the stop string"


def test_four_clients_at_once_each_get_their_own_answer(client, engine, ids):
    questions = [f"What is the capital of {country}?" for country in ("France", "Japan", "Italy", "Egypt")]
    want = [expected(engine, [{"role": "user", "content": q}], SHORT) for q in questions]

    def ask(i: int) -> str:
        messages = [{"role": "user", "content": questions[i]}]
        request = dict(model=ids["eagle"], messages=messages, max_tokens=SHORT, temperature=0)
        if i % 2:
            chunks = client.chat.completions.create(**request, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks)
        return client.chat.completions.create(**request).choices[0].message.content

    with ThreadPoolExecutor(len(questions)) as pool:
        assert list(pool.map(ask, range(len(questions)))) == want


def test_more_clients_than_waiting_threads_still_each_get_their_answer(engine):
    """The turn's holder must never queue for a worker thread behind requests that wait for the turn (a deadlock).
    An in-process server with one waiting thread, so that three clients are more than it has; daemon threads
    throughout, so that a deadlock fails the test instead of hanging it."""
    api = Api(Access(), SHORT, waiting=1)
    api.attach(ChatService(engine), {"m": "eagle"})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=api.routes()), port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    questions = [[{"role": "user", "content": f"What is the capital of {c}?"}] for c in ("Spain", "Peru", "Chad")]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        reply = client.chat.completions.create(model="m", messages=questions[i], max_tokens=SHORT, temperature=0)
        answers[i] = reply.choices[0].message.content

    clients = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(questions))]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=300)
    server.should_exit = True
    assert answers == {i: expected(engine, messages, SHORT) for i, messages in enumerate(questions)}


def _leave_a_stream(server: str, client, model: str) -> None:
    stream = client.chat.completions.create(model=model, messages=STORY, max_tokens=LONG, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()


def _leave_a_whole_answer(server: str, client, model: str) -> None:
    body = dict(model=model, messages=STORY, max_tokens=LONG, temperature=0)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up mid-answer
        # half a second: at ~125 tokens/s (Zen 5, AVX-512) the whole answer took under 2 s
        httpx.post(f"{server}/v1/chat/completions", json=body, timeout=httpx.Timeout(0.5, connect=30))


@pytest.mark.parametrize("leave", [_leave_a_stream, _leave_a_whole_answer], ids=["streaming", "whole"])
def test_a_client_gone_mid_answer_frees_the_engine(server, client, ids, leave):
    before = engine_status(server)["rounds"]
    leave(server, client, ids["vanilla"])  # plain decoding: one token per round, a long and steady answer
    left = engine_status(server)
    deadline = time.monotonic() + 60
    while engine_status(server)["active"] and time.monotonic() < deadline:
        time.sleep(0.2)
    rounds = engine_status(server)["rounds"]
    time.sleep(3)
    assert engine_status(server) == {"object": "engine", "ready": True, "rounds": rounds, "active": 0}, (
        "the engine kept decoding for a client that had gone")
    ran_on = rounds - left["rounds"]
    assert ran_on <= 16, f"{ran_on} rounds: the answer ran on after the client left"
    assert rounds - before < LONG - 16, "the answer ran to its end: the client left too late to test anything"


def test_a_longer_max_tokens_than_the_server_gives_is_cut_there(client, ids):
    """The official client's max_tokens=1000 on a server started with --max-new-tokens LONG: an answer, cut at LONG."""
    reply = client.chat.completions.create(model=ids["vanilla"], messages=STORY, max_tokens=1000, temperature=0)
    cut = reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens <= LONG and cut == (reply.usage.completion_tokens == LONG)


@pytest.mark.parametrize("body, status, param, code", [
    (dict(n=2), 400, "n", "invalid_value"),
    (dict(temperature=3), 400, "temperature", "invalid_value"),
    (dict(top_p="high"), 400, "top_p", "invalid_value"),
    (dict(model="gpt-4o"), 404, "model", "model_not_found"),
    (dict(messages=[]), 400, "messages", "invalid_value"),
    (dict(messages=[{"role": "assistant", "content": "Hi"}]), 400, "messages", "invalid_value"),
    (dict(messages=[{"role": "tool", "content": "42"}]), 400, "messages.0.role", "invalid_value"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "unsupported_parameter"),
    (dict(max_tokn=5), 400, "max_tokn", "unknown_parameter"),
    (dict(max_tokens=0), 400, "max_tokens", "invalid_value"),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
    (dict(messages=[{"role": "user", "content": "lorem ipsum " * 5000}]), 400, "messages", "context_length_exceeded"),
])
def test_bad_requests_get_protocol_errors(server, ids, body, status, param, code):
    request = {"model": ids["eagle"], "messages": CAPITAL, "max_tokens": SHORT, **body}
    response = httpx.post(f"{server}/v1/chat/completions", json=request, timeout=120)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_malformed_or_oversized_bodies_and_unknown_routes_get_protocol_errors(server):
    not_json = httpx.post(f"{server}/v1/chat/completions", content=b"{model:", timeout=30)
    too_big = httpx.post(f"{server}/v1/chat/completions", content=b" " * (MAX_BODY_BYTES + 1), timeout=60)
    unknown = httpx.get(f"{server}/v1/embeddings", timeout=30)
    assert [r.status_code for r in (not_json, too_big, unknown)] == [400, 413, 404]
    assert "not valid JSON" in not_json.json()["error"]["message"]
    assert too_big.json()["error"]["code"] == "request_too_large"


def test_the_openai_client_raises_the_servers_message(client, ids):
    with pytest.raises(openai.BadRequestError, match="only n=1 is supported"):
        client.chat.completions.create(model=ids["eagle"], messages=CAPITAL, n=2)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL)


def test_api_only_server_with_a_key(tmp_path, engine):
    process, url = start_server("--api-only", "--api-key", KEY, "--max-new-tokens", str(SHORT),
                                log=tmp_path / "app.log", key=KEY)
    try:
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="not-the-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            wrong.models.list()
        bare = httpx.post(f"{url}/v1/chat/completions", json={}, timeout=30)
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
        assert bare.json()["error"]["code"] == "invalid_api_key"
        right = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)
        answer = right.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0)
        assert answer.choices[0].message.content == expected(engine, CAPITAL, SHORT)
        assert httpx.get(url + "/", timeout=30).status_code == 404  # no UI
    finally:
        stop_app(process)


def test_before_the_model_is_loaded_requests_get_503():
    client = TestClient(Starlette(routes=Api(Access(), SHORT).routes()))
    response = client.post("/v1/chat/completions", json={"model": "smollm2", "messages": CAPITAL})
    assert response.status_code == 503 and response.headers["retry-after"]
    assert response.json()["error"]["code"] == "model_loading"
    assert client.get("/v1/engine").json()["ready"] is False


def test_a_public_share_link_refuses_the_api_without_a_key_and_takes_the_ui_password():
    open_share = TestClient(Starlette(routes=Api(Access.from_options(None, None, share=True), SHORT).routes()))
    refused = open_share.get("/v1/models")
    assert refused.status_code == 403 and "--api-key" in refused.json()["error"]["message"]
    guarded = TestClient(Starlette(routes=Api(Access.from_options(None, [("me", "pw")], share=True), SHORT).routes()))
    assert guarded.get("/v1/models").status_code == 401
    assert guarded.get("/v1/models", headers={"Authorization": "Bearer me:pw"}).status_code == 503  # in, loading


@pytest.mark.parametrize("text, final, shown, stopped", [
    ("Hello\n\nUs", False, 5, False),  # "\n\nUs" may begin the stop string: held back
    ("Hello\n\nUser: hi", False, 5, True),
    ("Hello\n\nUs", True, 9, False),  # the answer ended: nothing more can complete it
    ("Hello wor", False, 9, False),
    ("ENDHello", False, 0, True),
])
def test_release_holds_back_what_may_begin_a_stop_string(text, final, shown, stopped):
    assert release(text, ("\n\nUser:", "END"), final) == (shown, stopped)
