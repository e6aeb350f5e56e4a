"""EAGLE-3 draft vocabulary: the most frequent reply tokens of the training data.

A smaller draft LM head makes every draft step cheaper; tokens outside it can still come from the base model
(as the bonus token), so the only cost is the acceptance lost on them, which `coverage` measures.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..draft.eagle3 import Eagle3Head
from ..draft.head import DraftHead


def token_counts(records: list[dict], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the replies (the positions the loss covers)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for record in records:
        reply = torch.tensor(record["input_ids"][record["prompt_len"]:], dtype=torch.long)
        counts += torch.bincount(reply, minlength=vocab_size)[:vocab_size]
    return counts


def record_sources(paths: list[str | Path]) -> list[Path]:
    """The data folders and record files to read: a folder of record files (.npz, no shards), as data/selfdistill
    is, stands for its files, in name order."""
    sources = []
    for path in map(Path, paths):
        files = sorted(path.glob("*.npz")) if path.is_dir() and not any(path.glob("shard_*.jsonl")) else []
        sources += files or [path]
    return sources


def read_training_records(paths: list[str | Path]) -> list[dict]:
    """Every record of the data folders and record files, each conversation once (files may overlap)."""
    from ..draft.records import unique_records
    from .data import read_shards

    return unique_records([r for source in record_sources(paths) for r in read_shards(source)])


def choose_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids, ascending (ties go to the lower id, so the choice is deterministic)."""
    if not 0 < size <= len(counts):
        raise ValueError(f"draft vocabulary size must be in 1..{len(counts)}, got {size}")
    order = torch.argsort(-counts, stable=True)
    return order[:size].sort().values


def coverage(counts: torch.Tensor, used: torch.Tensor) -> float:
    """Fraction of counted tokens that the draft vocabulary can propose."""
    total = counts.sum().item()
    return counts[used].sum().item() / total if total else 0.0


def draft_targets(head: Eagle3Head) -> torch.Tensor:
    """The base id each draft id proposes, in draft-id order."""
    return head.to_target(torch.arange(head.config.draft_vocab, device=head.d2t.device)).cpu()


def check_sliceable(head: DraftHead, size: int) -> None:
    """Refuse what cannot be sliced: only an EAGLE-3 head with a draft vocabulary map has rows to drop."""
    if head.kind != "eagle3":
        raise ValueError(f"only an EAGLE-3 head has a draft vocabulary to slice; this one is {head.kind}")
    if not head.has_vocab_map:
        raise ValueError("this EAGLE-3 head drafts over the full vocabulary (no d2t map): nothing to slice")
    current = head.config.draft_vocab
    if not 0 < size <= current:
        raise ValueError(f"sliced draft vocabulary size must be in 1..{current} (the head's), got {size}")


def kept_draft_ids(head: Eagle3Head, counts: torch.Tensor, size: int) -> torch.Tensor:
    """The draft ids of the `size` most frequent of the head's tokens (ties to the lower id), ordered by base id so
    the sliced head keeps the official layout: draft ids are its base ids in ascending order."""
    targets = draft_targets(head)
    kept = choose_vocab(counts.cpu()[targets], size)
    return kept[torch.argsort(targets[kept])]


def slice_vocab(head: Eagle3Head, counts: torch.Tensor, size: int) -> Eagle3Head:
    """A copy of an EAGLE-3 head that drafts over only the `size` most frequent of its draft tokens.

    Every other weight is copied unchanged and the LM head keeps the rows of the kept draft ids, so over those tokens
    the logits are the original's and the new d2t maps them to the same base ids: the drafts lose only the dropped
    tokens, which `coverage` prices.
    """
    check_sliceable(head, size)
    if len(counts) != head.config.vocab_size:
        raise ValueError(f"counts cover {len(counts)} tokens, the head's base vocabulary has {head.config.vocab_size}")
    kept = kept_draft_ids(head, counts, size)
    weight = head.lm_head.weight.detach()
    sliced = Eagle3Head(replace(head.config, draft_vocab_size=size))
    if head.embed_tokens is not None:
        sliced.embed_tokens = nn.Embedding(head.config.vocab_size, head.config.hidden_size)
    sliced.to(device=weight.device, dtype=weight.dtype)
    sliced.set_vocab(draft_targets(head)[kept])
    rows = weight[kept.to(weight.device)]
    sliced.load_state_dict(head.state_dict() | {"lm_head.weight": rows, "d2t": sliced.d2t, "t2d": sliced.t2d})
    sliced.train(head.training).requires_grad_(any(p.requires_grad for p in head.parameters()))
    if head._base:
        sliced.attach(head._base[0])
    return sliced
