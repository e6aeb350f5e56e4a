"""The fit stage end to end: records -> draft vocabulary -> features -> training -> head in the official layout."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..draft.checkpoint import load_head, new_head
from ..draft.head import DraftHead
from .data import read_shards
from .features import CachedFeatures, LiveFeatures, cache_features
from .fit import FitConfig, Trainer
from .vocab import choose_vocab, coverage, token_counts


def load_records(folders: list[str | Path], val_every: int) -> tuple[list[dict], list[int], list[int]]:
    """All records of the data folders; every `val_every`-th record of the FIRST folder is held out.

    Put self-distilled data first: it is what the head meets at inference, so its validation figures mean most.
    Records sharing an id with a validation record are left out of training.
    """
    records, first_count = [], None
    for folder in folders:
        records += read_shards(folder)
        first_count = len(records) if first_count is None else first_count
    val = list(range(0, first_count, val_every)) if val_every else []
    held = {records[i]["id"] for i in val}
    train = [i for i in range(len(records)) if i not in set(val) and records[i]["id"] not in held]
    return records, train, val


def draft_vocab(records: list[dict], train: list[int], val: list[int], vocab_size: int, size: int,
                work: Path, used: torch.Tensor | None = None) -> torch.Tensor:
    """Choose (or reload, so a resumed run keeps it) the draft vocabulary, unless `used` is given; print coverage."""
    file = work / "draft_vocab.pt"
    train_counts = token_counts([records[i] for i in train], vocab_size)
    if used is None:
        used = torch.load(file) if file.exists() else choose_vocab(train_counts, size)
        torch.save(used, file)
    figures = {"draft_vocab_size": len(used), "train_coverage": coverage(train_counts, used)}
    if val:
        figures["val_coverage"] = coverage(token_counts([records[i] for i in val], vocab_size), used)
    print("draft vocabulary: " + json.dumps(figures))
    (work / "vocab_coverage.json").write_text(json.dumps(figures, indent=2))
    return used


def starting_head(base_model, kind: str, draft_vocab_size: int, init: str | Path | None) -> DraftHead:
    """A new head of `kind`, or (fine-tuning) the trained head `init` in float32, which must be of that kind."""
    if init is None:
        return new_head(kind, base_model.config, draft_vocab_size if kind == "eagle3" else None)
    head = load_head(init, base_model, dtype=torch.float32)
    if head.kind != kind:
        raise ValueError(f"--init {init} is an {head.kind} head, but --kind {kind} was asked for")
    return head


def fit_head(base_model, data: list[str | Path], out: str | Path, work: str | Path, kind: str = "eagle3",
             draft_vocab_size: int = 16384, config: FitConfig | None = None, cache: bool = True,
             val_every: int = 20, max_steps: int | None = None, time_limit_s: float | None = None,
             dtype: torch.dtype = torch.float16, init: str | Path | None = None) -> dict:
    """Train a head on the data folders and write it to `out`; `work` keeps features and checkpoints (resumable).

    `init` (a head folder or hub id) fine-tunes that head, keeping its draft vocabulary, instead of a new one.
    """
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    config = config or FitConfig()
    records, train, val = load_records(data, val_every)
    text = base_model.config.get_text_config()
    head = starting_head(base_model, kind, min(draft_vocab_size, text.vocab_size), init)
    if kind == "eagle3" and head.has_vocab_map:
        kept = head.to_target(torch.arange(len(head.d2t), device=head.d2t.device)).cpu() if init else None
        head.set_vocab(draft_vocab(records, train, val, text.vocab_size, draft_vocab_size, work, kept))
    head.to(next(base_model.parameters()).device)
    layers = head.feature_layers(text.num_hidden_layers)  # a fine-tuned head's own, where its config names them
    if cache:
        folder = work / f"features-{kind}"
        source = CachedFeatures(cache_features(base_model, records, folder, kind, layers=layers), records)
    else:
        source = LiveFeatures(base_model, records, kind, layers)
    trainer = Trainer(head, base_model, source, train, val, config, work, from_base=init is None)
    summary = trainer.fit(max_steps=max_steps, time_limit_s=time_limit_s)
    trainer.save_head(out, dtype)
    summary.update(kind=kind, out=str(out), train_records=len(train), val_records=len(val), init=init and str(init),
                   train_tokens=sum(len(records[i]["input_ids"]) - records[i]["prompt_len"] for i in train))
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_summary(summary: dict) -> None:
    val = summary.get("validation") or {}
    print(f"\n== {summary['kind']} head written to {summary['out']}")
    print(f"   steps {summary['steps']}/{summary['total_steps']} ({summary['steps_this_run']} this run, "
          f"{summary['seconds']:.0f}s), train records {summary['train_records']} "
          f"({summary['train_tokens']} reply tokens), validation records {summary['val_records']}")
    if val:
        print(f"   validation loss {val['loss']:.3f}; per-step accuracy "
              + " ".join(f"{a:.2f}" for a in val["accuracy"]))
        print("   acceptance per step " + " ".join(f"{a:.2f}" for a in val["acceptance"])
              + f"; expected accepted length of a greedy chain {val['chain_tau']:.2f}")
