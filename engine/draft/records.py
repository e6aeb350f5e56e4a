"""Training records in one compact file that a fresh checkout finds: token ids only, deduplicated, compressed.

A data run writes JSONL shards into a working folder (runs/), which may be gone on the next machine; hours of
self-distillation should not be. `python -m engine.train export` packs shards into a .npz (numpy's zip-deflated
arrays: uint16 ids when the vocabulary fits, offsets, prompt lengths, ids), small enough to commit;
`fit --data FILE.npz` trains from it directly and `import` writes it back as shards for a data run to resume after.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FORMAT = "eagle-train-records/1"


def unique_records(records: list[dict]) -> list[dict]:
    """Records in order, without a repeated id or a repeated token sequence (the first one is kept)."""
    seen_ids, seen_tokens, kept = set(), set(), []
    for record in records:
        tokens = tuple(record["input_ids"])
        if record["id"] in seen_ids or tokens in seen_tokens:
            continue
        seen_ids.add(record["id"])
        seen_tokens.add(tokens)
        kept.append(record)
    return kept


def save_records(records: list[dict], path: str | Path, meta: dict | None = None) -> dict:
    """Write records ({"id", "input_ids", "prompt_len"}) deduplicated to `path` (.npz); returns the file's summary."""
    records = unique_records(records)
    if not records:
        raise ValueError("no records to save")
    lengths = np.array([len(r["input_ids"]) for r in records], dtype=np.int64)
    flat = np.fromiter((t for r in records for t in r["input_ids"]), dtype=np.int64, count=int(lengths.sum()))
    dtype = np.uint16 if flat.max() < 2**16 else np.uint32
    prompt_lens = np.array([r["prompt_len"] for r in records], dtype=np.int32)
    summary = {"format": FORMAT, "records": len(records), "tokens": int(lengths.sum()),
               "reply_tokens": int((lengths - prompt_lens).sum()), **(meta or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")  # written whole, then renamed: a reader never sees half a file
    np.savez_compressed(tmp, tokens=flat.astype(dtype), offsets=np.concatenate([[0], np.cumsum(lengths)]),
                        prompt_lens=prompt_lens, ids=np.array([str(r["id"]) for r in records]),
                        meta=np.array(json.dumps(summary)))
    tmp.rename(path)
    return summary


def load_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray, list[int], list[str]]:
    """A file written by save_records as arrays: all tokens (int64), the records' offsets into them (one more
    than records), prompt lengths and ids."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"record file {path} does not exist")
    with np.load(path, allow_pickle=False) as data:
        missing = {"tokens", "offsets", "prompt_lens", "ids", "meta"} - set(data.files)
        if missing or json.loads(str(data["meta"])).get("format") != FORMAT:
            raise ValueError(f"{path} is not a training-record file ({FORMAT}): "
                             + (f"missing {', '.join(sorted(missing))}" if missing else "another format"))
        tokens, offsets = data["tokens"].astype(np.int64), data["offsets"]
        prompt_lens, ids = data["prompt_lens"].tolist(), data["ids"].tolist()
    if len(offsets) != len(ids) + 1 or offsets[-1] != len(tokens):
        raise ValueError(f"{path} is damaged: its offsets do not match its {len(tokens)} tokens and {len(ids)} ids")
    return tokens, offsets, prompt_lens, ids


def load_records(path: str | Path) -> list[dict]:
    """The records of a file written by save_records, in its order."""
    tokens, offsets, prompt_lens, ids = load_arrays(path)
    return [{"id": ident, "input_ids": tokens[offsets[i]:offsets[i + 1]].tolist(), "prompt_len": prompt_lens[i]}
            for i, ident in enumerate(ids)]
