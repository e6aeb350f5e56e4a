"""EAGLE-3 draft vocabulary: the most frequent reply tokens of the training data.

A smaller draft LM head makes every draft step cheaper; tokens outside it can still come from the base model
(as the bonus token), so the only cost is the acceptance lost on them, which `coverage` measures.
"""
from __future__ import annotations

import torch


def token_counts(records: list[dict], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the replies (the positions the loss covers)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for record in records:
        reply = torch.tensor(record["input_ids"][record["prompt_len"]:], dtype=torch.long)
        counts += torch.bincount(reply, minlength=vocab_size)[:vocab_size]
    return counts


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
