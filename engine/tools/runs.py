"""Running one decoding method on one prompt, for the benchmark and the tuning tools: what it produced, how long
it took, how many base-model forwards it needed."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..engine import Engine
from ..decode.round import Step
from ..decode.params import DecodeParams
from ..model.placement import wait_for

PROMPT_LOOKUP_TOKENS = 10
SHARED_QUESTIONS = Path(__file__).resolve().parents[3] / "shared" / "bench" / "mt_bench.jsonl"


@dataclass
class Run:
    """One method on one prompt."""

    token_ids: list[int]
    wall_s: float
    target_forwards: int
    steps: list[Step] = field(default_factory=list)  # engine methods only


def load_questions(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read MT-bench JSON lines ({question_id, category, turns}); a bad line is an error naming its number."""
    path = Path(path)
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        questions.append(_question(line, f"{path} line {number}"))
        if limit is not None and len(questions) == limit:
            break
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def _question(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg})") from err
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with question_id, category and turns")
    missing = [key for key in ("question_id", "category", "turns") if key not in record]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{where}: turns must be a non-empty list of strings")
    if not turns[0].strip():
        raise ValueError(f"{where}: the first turn is empty")
    return record


def first_turn_prompts(engine: Engine, questions: list[dict]) -> list[list[int]]:
    """Each question's first turn through the chat template (as plain text for a model without one); a prompt that
    leaves no room is an error."""
    prompts = []
    for q in questions:
        try:
            prompts.append(engine.encode_chat([{"role": "user", "content": q["turns"][0]}]))
        except ValueError as err:
            raise ValueError(f"question {q['question_id']}: {err}") from None
        if len(prompts[-1]) >= engine.max_context:
            raise ValueError(f"question {q['question_id']}: {len(prompts[-1])} tokens, the context holds "
                             f"{engine.max_context}")
    return prompts


@contextmanager
def count_forwards(module: torch.nn.Module):
    """Count calls of `module` (the base model's decoder) while the block runs."""
    calls = [0]
    hook = module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        hook.remove()


def run_engine(engine: Engine, prompt: list[int], params: DecodeParams) -> Run:
    start = time.perf_counter()
    steps = list(engine.generate(prompt, params))
    wall = time.perf_counter() - start
    return Run([tok for step in steps for tok in step.tokens], wall, len(steps), steps)


def run_hf(engine: Engine, model: PreTrainedModel, prompt: list[int], params: DecodeParams, lookup: bool) -> Run:
    """transformers `generate`, its output cut after the first stop token as the engine's Step stream is."""
    temperature = params.sampling.temperature
    kwargs = dict(
        max_new_tokens=params.max_new_tokens,
        eos_token_id=list(engine.stop_ids),
        pad_token_id=engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else engine.stop_ids[0],
        do_sample=not params.sampling.greedy,
    )
    if not params.sampling.greedy:
        kwargs.update(temperature=temperature, top_p=params.sampling.top_p, top_k=params.sampling.top_k)
        if params.seed is not None:
            torch.manual_seed(params.seed)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    ids = torch.tensor([prompt], device=model.device)
    with count_forwards(model.get_decoder()) as calls, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        wait_for(out.device)  # kernels may still be queued; the engine's Steps hold Python ints, so they are done
        wall = time.perf_counter() - start
    tokens = out[0, len(prompt):].tolist()[: params.max_new_tokens]
    stop = next((i for i, tok in enumerate(tokens) if tok in engine.stop_ids), None)
    return Run(tokens if stop is None else tokens[: stop + 1], wall, calls[0])
