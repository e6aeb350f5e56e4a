"""The chat service and UI handlers on a tiny random model with the real tokenizer: streaming, Stop, bad input."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import gradio as gr
import pytest
import torch

from app.chat import ChatService
from app.conversation import Conversation
from app.history import History, owner_of
from app.store import ChatStore
from app.meter import SETTLING, TurnMeter
from app.ui import ANSWER_TOKENS, EMPTY_HINT, Handlers
from conftest import random_head, tiny_base, tokens_of
from engine import ContextTooLong, DecodeParams, Engine
from engine.model.load import load_tokenizer

CONTEXT = 256  # the tiny model's context window, so over-long input is cheap to make


@pytest.fixture(scope="module")
def engine() -> Engine:
    tokenizer = load_tokenizer()
    model = tiny_base("llama-h64-l8-gqa", vocab=len(tokenizer))
    model.config.max_position_embeddings = CONTEXT
    return Engine.over(model, tokenizer, random_head(model, "eagle3"))


@pytest.fixture
def service(engine) -> ChatService:
    return ChatService(engine)


@pytest.fixture
def handlers(service) -> Handlers:
    return Handlers(service, max_new_tokens=64)


def settings(**changes) -> dict:
    """The settings controls' values, by the names the page passes them under."""
    return {"method": "eagle", "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 12, "total_tokens": 8, "depth": 3,
            "min_prob": 0.0, "context": True, "gate": True, **changes}


def test_the_settings_reach_the_decode_parameters(handlers):
    params = handlers.params(**settings(temperature=0.7, total_tokens=12.0, min_prob=0.25))
    assert params.method == "eagle" and params.sampling.temperature == 0.7 and params.tree.total_tokens == 12
    assert params.tree.min_prob == 0.25
    assert handlers.params(**settings()).tree.min_prob is None  # the slider's 0: the floor the row cost sets
    assert params.context is not None and params.plain_every > 0
    assert handlers.params(**settings(context=False)).context is None
    assert params.gated and not handlers.params(**settings(gate=False)).gate
    assert handlers.params(**settings(method="suffix")).method == "suffix"
    assert handlers.service.methods == ("eagle", "suffix", "vanilla")


def test_the_answer_limit_follows_the_models_context(service, handlers):
    """Without --max-new-tokens an answer may run as long as the context holds; with it, no longer than that."""
    unbounded = Handlers(service)
    assert unbounded.max_new_tokens == CONTEXT and unbounded.default_answer == min(ANSWER_TOKENS, CONTEXT)
    assert unbounded.params(**settings(max_new_tokens=10**6)).max_new_tokens == CONTEXT
    assert handlers.params(**settings(max_new_tokens=10**6)).max_new_tokens == 64
    assert handlers.params(**settings(max_new_tokens=0)).max_new_tokens == 1


def ask(handlers: Handlers, conversation: Conversation, text: str, **changes) -> list[tuple]:
    _, conversation, _ = handlers.add_message(text, conversation)
    return list(handlers.answer(conversation, True, **settings(**changes)))


def test_stream_gives_every_token_and_the_latest_state(engine, service):
    ids = engine.encode_chat([{"role": "user", "content": "Hello there"}])
    params = DecodeParams().with_options(method="eagle", max_new_tokens=16, total_tokens=8, depth=3)
    expected = list(engine.generate(ids, params))
    updates = [(answer.ids[:], turn.rounds) for answer, turn in service.stream(ids, params)]
    assert service.rounds == len(expected)  # every step counted once, prefill included
    assert updates[-1] == (tokens_of(expected), len(expected) - 1)
    rounds = [r for _, r in updates]
    assert rounds == sorted(set(rounds)), "each update shows a later state than the one before"
    answer, turn = list(service.stream(ids, params))[-1]
    assert answer.drafted == [d for s in expected for d in s.drafted]
    assert answer.from_context == [c for s in expected for c in s.from_context]
    assert answer.text == engine.tokenizer.decode(answer.ids, skip_special_tokens=True)
    assert turn.finish_reason in ("eos", "length")


def test_decoding_runs_ahead_of_a_slow_reader(engine, service):
    """No decoding step waits for the page: while the reader is busy (rendering, sending), rounds go on."""
    ids = engine.encode_chat([{"role": "user", "content": "Tell me a long story"}])
    stream = service.stream(ids, DecodeParams(method="vanilla", max_new_tokens=60))
    next(stream)
    before = service.rounds
    time.sleep(1.0)  # a reader that takes its time
    assert service.rounds > before + 3
    *_, (answer, turn) = stream
    assert len(answer.ids) == turn.tokens + 1 == service.rounds


def test_the_meter_baseline_is_timed_in_the_answer_itself(engine, service):
    ids = engine.encode_chat([{"role": "user", "content": "Hi"}])
    *_, (_, plain) = service.stream(ids, DecodeParams(method="vanilla", max_new_tokens=12))
    assert plain.speedup == 1.0
    *_, (_, turn) = service.stream(ids, DecodeParams(method="eagle", max_new_tokens=40, plain_every=SETTLING + 4,
                                                           plain_run=SETTLING + 2))
    assert turn.plain.steps >= 2 and turn.speculative.steps > 0
    assert turn.speedup == pytest.approx(turn.tokens_per_s / turn.plain_per_s)


def test_every_engine_step_runs_on_the_one_engine_thread(engine, service):
    threads = []
    hook = engine.target.body.register_forward_pre_hook(lambda *_: threads.append(threading.current_thread().name))
    try:
        ids = engine.encode_chat([{"role": "user", "content": "Hello there"}])
        for _ in range(2):  # two turns, each driven from a thread of its own, as Gradio does
            worker = threading.Thread(
                target=lambda: list(service.stream(ids, DecodeParams().with_options(method="eagle", max_new_tokens=8))))
            worker.start()
            worker.join(60)
    finally:
        hook.remove()
    assert len(threads) > 4 and len(set(threads)) == 1 and threads[0].startswith("engine")


def test_a_throttled_stream_skips_updates_but_no_tokens(engine, service):
    ids = engine.encode_chat([{"role": "user", "content": "Hello there"}])
    expected = list(engine.generate(ids, method="eagle", max_new_tokens=16, total_tokens=8, depth=3))
    params = DecodeParams().with_options(method="eagle", max_new_tokens=16, total_tokens=8, depth=3)
    updates = [(answer.ids[:], turn.rounds) for answer, turn in service.stream(ids, params, every_s=60)]
    assert len(expected) > 2 and len(updates) <= 2  # the first state, then the last (long before 60 s)
    assert updates[-1] == (tokens_of(expected), len(expected) - 1)


def test_closing_the_stream_stops_decoding_and_frees_the_engine(engine, service):
    ids = engine.encode_chat([{"role": "user", "content": "Tell me a long story"}])
    stream = service.stream(ids, DecodeParams().with_options(method="vanilla", max_new_tokens=200))
    for _ in range(3):
        next(stream)
    assert service.active == 1
    stream.close()  # what Gradio does on Stop or a disconnect
    stopped_at = service.rounds
    time.sleep(0.5)
    assert service.active == 0 and service.rounds == stopped_at < 200  # no round after the one in progress
    started = threading.Event()
    worker = threading.Thread(
        target=lambda: (next(engine.generate(ids, method="vanilla", max_new_tokens=1)), started.set()), daemon=True)
    worker.start()
    assert started.wait(30), "the engine is still locked after the stream was closed"


def test_old_turns_are_dropped_to_fit_and_an_over_long_message_is_refused(engine, service):
    turn = "word " * 40
    messages = [{"role": "system", "content": "Be brief."}]
    for _ in range(3):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": turn}]
    messages.append({"role": "user", "content": "And now?"})
    ids, dropped = service.fit(messages, max_new_tokens=32)
    assert dropped > 0 and dropped % 2 == 0 and len(ids) + 32 <= CONTEXT
    assert ids == engine.encode_chat(messages[:1] + messages[1 + dropped :])  # the system message stays
    with pytest.raises(ContextTooLong, match=r"your message is \d+ tokens long; this model reads at most 256"):
        service.fit([{"role": "user", "content": "word " * 400}], max_new_tokens=32)


def test_a_chat_turn_streams_html_and_keeps_the_text_for_the_model(handlers):
    conversation = Conversation()
    updates = ask(handlers, conversation, "Hi <b>there</b>")
    assert len(updates) > 1
    conversation_out, shown, meter, *_ = updates[-1]
    assert conversation_out is conversation and not conversation.busy
    assert [m["role"] for m in shown] == ["user", "assistant"]
    assert "&lt;b&gt;there&lt;/b&gt;" in shown[0]["content"]
    assert 'class="base"' in shown[1]["content"] or 'class="drafted"' in shown[1]["content"]
    assert 'data-state="idle"' in meter and 'data-rounds="' in meter
    reply = conversation.messages()[-1]
    assert reply["role"] == "assistant" and "<span" not in reply["content"]
    assert "Stopped at the token limit" in shown[1]["content"] or conversation.turns[-1].meter.finish_reason == "eos"


def test_empty_message_is_ignored_with_a_hint(handlers):
    conversation = Conversation()
    with pytest.warns(UserWarning, match=re.escape(EMPTY_HINT)):
        text, conversation, shown = handlers.add_message("   \n ", conversation)
    assert shown == [] and conversation.turns == []
    assert list(handlers.answer(conversation, True, **settings()))[-1][1] == []  # nothing to answer


def test_over_long_message_gets_a_clear_message_in_the_chat(handlers):
    conversation = Conversation()
    updates = ask(handlers, conversation, "word " * 400)
    shown = updates[-1][1]
    assert len(shown) == 2 and "tokens long" in shown[1]["content"] and "Traceback" not in shown[1]["content"]
    assert conversation.messages() == []  # the refused message is not in the model's context
    updates = ask(handlers, conversation, "Short question")  # the chat goes on
    assert (conversation.messages()[0]["content"] == "Short question"
            and conversation.messages()[-1]["role"] == "assistant")


def test_bad_settings_and_failures_never_show_a_traceback(handlers, monkeypatch):
    conversation = Conversation()
    shown = ask(handlers, conversation, "Hello", total_tokens=1)[-1][1]
    assert "total_tokens must be" in shown[-1]["content"] or "total_tokens" in shown[-1]["content"]

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals")
        yield

    monkeypatch.setattr(handlers.service, "stream", broken)
    shown = ask(handlers, conversation, "Hello again")[-1][1]
    assert "Something went wrong" in shown[-1]["content"]
    assert "secret internals" not in shown[-1]["content"] and "Traceback" not in shown[-1]["content"]
    assert not conversation.busy


def test_stop_keeps_the_partial_answer_and_says_so(handlers, service):
    conversation = Conversation()
    handlers.add_message("Tell me a story", conversation)
    updates = handlers.answer(conversation, True, **settings(max_new_tokens=1000, method="vanilla"))
    next(updates)  # the first round's update: a second one, half a second later, may find the answer finished
    updates.close()  # Gradio closes the generator when Stop cancels the event
    assert not conversation.busy and service.active == 0
    kept = len(conversation.last_answer().answer.ids)
    _, shown, meter, *_ = handlers.after_stop(conversation)
    assert 0 < kept < 1000 and f"Stopped after {kept} tokens." in shown[-1]["content"]
    assert 'data-state="idle"' in meter and "stopped" in meter
    assert conversation.messages()[-1]["role"] == "assistant"  # the partial answer stays in the history


def test_an_answer_is_kept_with_its_figures_when_it_ends_and_a_stopped_one_too(service, tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    handlers = Handlers(service, max_new_tokens=64, history=History(store))
    conversation = Conversation()
    _, shown, _, chats, export, export_json, title, saving = ask(handlers, conversation, "Name a colour")[-1]
    [kept] = store.chats("local")
    assert kept.title == title == "Name a colour" and chats["value"] == kept.id == conversation.chat_id
    assert saving == "" and Path(export["value"]).read_text().startswith("# Name a colour")
    reply = store.load(kept.id, "local").messages[-1]
    tokens = len(conversation.turns[-1].answer.ids)
    assert reply["figures"]["tokens"] == tokens and reply["figures"]["method"] == "eagle"
    assert reply["figures"]["drafted"] >= reply["figures"]["accepted"] == sum(conversation.turns[-1].answer.drafted)
    assert "tokens/s" in shown[-1]["content"] and "reply-figures" in shown[-1]["content"]

    handlers.add_message("Tell me a story", conversation)
    updates = handlers.answer(conversation, True, **settings(max_new_tokens=1000, method="vanilla"))
    next(updates)
    updates.close()
    handlers.after_stop(conversation)
    stopped = store.load(kept.id, "local").messages[-1]
    assert stopped["note"].startswith("Stopped after") and stopped["figures"]["finish"] is None
    assert len(store.chats("local")) == 1  # the same chat, saved again


def test_regenerate_answers_the_last_message_again(handlers):
    conversation = Conversation()
    ask(handlers, conversation, "Name a colour")
    first = conversation.messages()[-1]["content"]
    handlers.regenerate(conversation)
    assert conversation.waiting
    list(handlers.answer(conversation, True, **settings()))
    assert len(conversation.messages()) == 2 and conversation.messages()[-1]["content"] == first  # greedy: same


def test_provenance_can_be_switched_off_for_the_whole_chat(handlers):
    conversation = Conversation()
    ask(handlers, conversation, "Hello")
    assert "<span" not in handlers.rerender(conversation, False)[1]["content"]
    assert "<span" in handlers.rerender(conversation, True)[1]["content"]


def test_side_by_side_reports_identical_greedy_outputs(handlers):
    updates = list(handlers.compare("Compare me", True, max_new_tokens=16, total_tokens=8, depth=3))
    plain, eagle, verdict, _ = updates[-1]
    assert 'data-verdict="identical"' in verdict and "Identical" in verdict
    assert re.sub(r'<span class="\w+"', "", plain) == re.sub(r'<span class="\w+"', "", eagle)


def test_side_by_side_explains_where_outputs_part(handlers, engine):
    """A difference is reported with the base model's two likeliest tokens at the first differing position."""
    from app.render import Answer
    from app.ui import _compare_verdict

    prompt = engine.encode_chat([{"role": "user", "content": "Compare me"}])
    a, b = [5, 6, 7, 8], [5, 6, 9]
    finished = {"vanilla": (Answer(ids=a), TurnMeter("vanilla")), "eagle": (Answer(ids=b), TurnMeter("eagle"))}
    explained = handlers._where_they_part(prompt, finished)
    logits = engine.model(torch.tensor([prompt + a[:2]])).logits[0, -1]
    top, second = (engine.tokenizer.decode([int(t)]) for t in logits.topk(2).indices)
    assert repr(top) in explained and repr(second) in explained and engine.exactness in explained
    verdict = _compare_verdict(finished["vanilla"], finished["eagle"], explained)
    assert 'data-verdict="different"' in verdict and "differ from token 2 on (4 vs 3 tokens)" in verdict
    assert handlers._where_they_part(prompt, {**finished, "eagle": finished["vanilla"]}) == ""


def test_two_sessions_at_once_each_get_their_own_answer(handlers, engine):
    prompts = ["First question", "A different second question"]
    alone = [engine.chat_text([{"role": "user", "content": p}], method="eagle", max_new_tokens=12, total_tokens=8,
                              depth=3) for p in prompts]
    conversations = [Conversation(), Conversation()]
    threads = [threading.Thread(target=ask, args=(handlers, c, p)) for c, p in zip(conversations, prompts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for conversation, prompt, expected in zip(conversations, prompts, alone):
        messages = conversation.messages()
        assert [m["content"] for m in messages] == [prompt, expected]


def test_whose_chats_a_page_shows(service, tmp_path):
    """Signed-in users own their chats; on a public page without sign-in each browser owns its own; on this machine
    alone there is one user. Two owners never see each other's chats in the list."""
    assert owner_of(gr.Request(username="ann"), "b1", shared=True) == "user:ann"
    assert owner_of(gr.Request(), "b1", shared=True) == "browser:b1" != owner_of(gr.Request(), "b2", shared=True)
    assert owner_of(gr.Request(), "b1", shared=False) == owner_of(None, "", shared=False) == "local"
    history = History(ChatStore(tmp_path / "chats.sqlite3"), shared=True)
    handlers = Handlers(service, max_new_tokens=64, history=history)
    for browser, text in (("b1", "Name a colour"), ("b2", "Name an animal")):
        conversation = Conversation()
        handlers.add_message(text, conversation)
        list(handlers.answer(conversation, True, browser=browser, request=gr.Request(), **settings()))
    listed = {browser: history.listing(f"browser:{browser}")["choices"] for browser in ("b1", "b2")}
    assert [title for title, _ in listed["b1"]] == ["Name a colour"]
    assert [title for title, _ in listed["b2"]] == ["Name an animal"]
