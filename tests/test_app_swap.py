"""Another model for the app's one engine, between turns: from the Models tab (app/models_panel.py) or an API request
naming it (app/api.py), over real tiny GGUF files. A swapped-in model answers exactly as a fresh load of it; a load
that fails or is refused leaves the old model answering; no swap happens under a streaming answer."""
from __future__ import annotations

from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from app import models_panel
from app.api import Access, Api
from app.chat import Busy, ChatService, ModelChanged
from app.models import ModelFolders, describe
from app.models_panel import ModelsPanel
from engine import DecodeParams, Engine, LoadOptions
from engine.draft.checkpoint import CheckpointError, save_head
from engine.model import kernels
from engine.testing.tiny import random_head, tiny_base
from engine.testing.tiny_gguf import GGUF_SHAPES, GGUF_VOCAB, tiny_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"engine/model/kernels: {kernels.unavailable_reason()}")
HELLO = [{"role": "user", "content": "hello there"}]
GREEDY = DecodeParams(method="vanilla", max_new_tokens=12)


@pytest.fixture
def models(tmp_path, monkeypatch) -> Path:
    """A models folder: a tiny Llama and a tiny Qwen2 GGUF, and an EAGLE-3 head for the Llama."""
    monkeypatch.setenv("EAGLE_CHAT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "models"
    folder.mkdir()
    for architecture in ("llama", "qwen2"):
        tiny_gguf(architecture, folder, "Q8_0")
    save_head(random_head(tiny_base(GGUF_SHAPES["llama"], GGUF_VOCAB), "eagle3"), folder / "llama-eagle3")
    return folder


def path_of(models: Path, architecture: str) -> Path:
    return next(models.glob(f"{GGUF_SHAPES[architecture]}-*.gguf"))


def service_on(path: Path) -> ChatService:
    options = LoadOptions(base=str(path), head=None)
    return ChatService(Engine.from_options(options), options=options)


def greedy_ids(service: ChatService, messages: list[dict] = HELLO) -> list[int]:
    ids, _ = service.fit(messages, GREEDY.max_new_tokens)
    *_, (answer, _) = service.stream(ids, GREEDY)
    return answer.ids


def test_a_swapped_in_model_answers_as_a_fresh_load_of_it_does(models):
    service = service_on(path_of(models, "llama"))
    qwen = path_of(models, "qwen2")
    service.swap(LoadOptions(base=str(qwen), head=None))
    assert service.engine.description().architecture == "qwen2" and service.names().base == qwen.name
    fresh = service_on(qwen)
    assert greedy_ids(service) == greedy_ids(fresh)


def test_a_load_that_fails_leaves_the_old_model_answering(models):
    service = service_on(path_of(models, "qwen2"))
    before, answer = service.engine, greedy_ids(service)
    with pytest.raises(CheckpointError, match="does not fit"):
        service.swap(LoadOptions(base=str(path_of(models, "qwen2")), head=str(models / "llama-eagle3")))
    assert service.engine is before and greedy_ids(service) == answer


def test_no_swap_while_an_answer_streams_and_a_turn_encoded_for_the_old_model_is_refused(models):
    service = service_on(path_of(models, "llama"))
    old = service.engine
    ids, _ = service.fit(HELLO, 40)
    streaming = service.stream(ids, DecodeParams(method="vanilla", max_new_tokens=40))
    next(streaming)
    with pytest.raises(Busy, match="an answer is being written"):
        service.swap(LoadOptions(base=str(path_of(models, "qwen2")), head=None))
    streaming.close()
    service.swap(LoadOptions(base=str(path_of(models, "qwen2")), head=None))
    with pytest.raises(ModelChanged, match="another model was loaded"):
        list(service.stream(ids, GREEDY, encoded_by=old))


def test_the_models_tab_refuses_what_cannot_load_and_keeps_the_model(models, tmp_path, monkeypatch):
    service = service_on(path_of(models, "qwen2"))
    panel = ModelsPanel(service, ModelFolders(models=models))
    (tmp_path / "notes.gguf").write_text("not a model")
    cases = {
        str(tmp_path / "notes.gguf"): "GGUF",
        str(tmp_path / "missing.gguf"): "does not exist",
        str(path_of(models, "qwen2")) + "|" + str(models / "llama-eagle3"): "does not fit",
    }
    for asked, reason in cases.items():
        path, _, head = asked.partition("|")
        status, *_ = panel.load(path, head or "none", progress=lambda *a, **k: None)
        assert 'data-state="refused"' in status and reason in status, status
    small = describe(path_of(models, "llama")).memory // 2
    monkeypatch.setattr(models_panel, "machine_memory", lambda: (small, small))
    status, *_ = panel.load(str(path_of(models, "llama")), "none", progress=lambda *a, **k: None)
    assert 'data-state="refused"' in status and "more than" in status, status
    assert service.names().base == path_of(models, "qwen2").name


def test_the_models_tab_loads_a_model_with_the_head_that_fits_it(models):
    service = service_on(path_of(models, "qwen2"))
    panel = ModelsPanel(service, ModelFolders(models=models))
    llama = path_of(models, "llama")
    _, heads = panel.inspect(str(llama))
    fitting = [value for label, value in heads["choices"] if "fits" in label and "not" not in label]
    assert fitting == [str(models / "llama-eagle3")], heads["choices"]
    status, _, methods, _ = panel.load(str(llama), fitting[0], progress=lambda *a, **k: None)
    assert 'data-state="loaded"' in status and f'data-base="{llama.name}"' in status, status
    assert service.engine.head is not None and "eagle" in [value for _, value in methods["choices"]]
    assert service.names().head == "llama-eagle3"


def test_an_api_request_naming_another_model_loads_it(models):
    service = service_on(path_of(models, "qwen2"))
    client = TestClient(Starlette(routes=_api(service, ModelFolders(models=models)).routes()))
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    llama, qwen = path_of(models, "llama").name, path_of(models, "qwen2").name
    assert listed[qwen]["loaded"] and not listed[llama]["loaded"]
    assert listed[f"{llama}+llama-eagle3"]["method"] == "eagle"
    answer = client.post("/v1/chat/completions", json={
        "model": f"{llama}+llama-eagle3", "messages": HELLO, "max_tokens": 12, "temperature": 0}).json()
    assert answer["model"] == f"{llama}+llama-eagle3" and answer["eagle"]["method"] == "eagle", answer
    assert answer["timings"]["predicted_n"] == answer["usage"]["completion_tokens"]
    fresh = Engine.load(str(path_of(models, "llama")), head=str(models / "llama-eagle3"))
    want = fresh.chat_text(HELLO, DecodeParams(method="eagle", max_new_tokens=12))
    assert answer["choices"][0]["message"]["content"] == want
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert listed[f"{llama}+llama-eagle3"]["loaded"] and not listed[qwen]["loaded"]


def test_without_swapping_an_unknown_model_gets_404_with_the_served_ids(models):
    service = service_on(path_of(models, "qwen2"))
    client = TestClient(Starlette(routes=_api(service, None).routes()))
    qwen, llama = path_of(models, "qwen2").name, path_of(models, "llama").name
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [qwen]
    refused = client.post("/v1/chat/completions", json={"model": llama, "messages": HELLO, "max_tokens": 4})
    assert refused.status_code == 404 and qwen in refused.json()["error"]["message"]
    assert service.names().base == qwen


def _api(service: ChatService, folders: ModelFolders | None) -> Api:
    api = Api(Access(), 64, folders=folders)
    api.attach(service)
    return api
