"""Self-distillation speed: engine.train.generation against transformers `generate`, on the same prompts, in turns.

The baseline is transformers' own batched generation: left-padded batches of prompts sorted by length,
transformers' DynamicCache growing by concatenation every step, on the packed model. Both sides get the
same ShareGPT prompts and the same token budget; rounds alternate so that a change in machine load hits both.

    python -m scripts.bench_generation --limit 64 --max-new-tokens 256 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.model.load import load_base, load_tokenizer
from engine.model.packed import pack_linears
from engine.train.data import read_conversations, select_prompts, stop_ids
from engine.train.generation import generate_replies, prepare_model


@torch.inference_mode()
def transformers_replies(model, prompts: list[list[int]], stops: list[int], pad_id: int, max_new_tokens: int,
                         batch_size: int) -> list[list[int]]:
    """Replies by transformers `generate`, batch by batch (left padding), each cut after its first stop token."""
    replies, order = [], sorted(prompts, key=len)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt):], attention[row, width - len(prompt):] = torch.tensor(prompt), 1
        out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=max_new_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None, eos_token_id=stops, pad_token_id=pad_id)
        for row in out[:, width:].tolist():
            replies.append(row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))])
    return replies


def timed(run) -> dict:
    start = time.perf_counter()
    replies = run()
    seconds = time.perf_counter() - start
    tokens = sum(map(len, replies))
    return {"reply_tokens": tokens, "seconds": round(seconds, 2), "reply_tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_generation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=64, help="ShareGPT prompts (the data command's selection)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=32, help="transformers generate's batch")
    parser.add_argument("--hf-dtypes", default="float32", help="comma-separated dtypes for transformers generate")
    parser.add_argument("--slots", default="64", help="comma-separated batch sizes for engine.train.generation")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two sides this many times")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    prompts = [p[2] for p in select_prompts(read_conversations(), tokenizer, args.limit, args.max_prompt_tokens)]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, threads {torch.get_num_threads()}")
    models = {}
    for dtype in args.hf_dtypes.split(","):
        models[f"transformers generate ({dtype})"] = model = load_base(None, dtype=dtype)[0]
        pack_linears(model)
    ours = load_base(None, dtype="float32")[0]
    prepare_model(ours)
    stops = stop_ids(tokenizer, ours)
    results = []
    for round_ in range(args.rounds):
        for name, model in models.items():
            run = lambda: transformers_replies(model, prompts, stops, tokenizer.pad_token_id, args.max_new_tokens,
                                               args.hf_batch_size)
            results.append({"round": round_, "method": name, **timed(run)})
            print(json.dumps(results[-1]), flush=True)
        for slots in map(int, args.slots.split(",")):
            run = lambda: list(dict(generate_replies(ours, prompts, stops, args.max_new_tokens, slots)).values())
            results.append({"round": round_, "method": f"engine.train.generation (float32, {slots} slots)",
                            **timed(run)})
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
