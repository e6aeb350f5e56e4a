"""What one verification forward costs as the tree grows: the curve that decides how big a draft tree pays off.

A round costs drafting + one base forward over all tree nodes, and it pays back the mean accepted length tau
in tokens; a tree of T nodes is worth it only while tau grows faster than the forward's cost over a plain step.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..model.cache import truncate
from ..model.target import Target
from ..draft.tree import DraftTree


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verification_curve(
    target: Target, tree_sizes: list[int], cache_tokens: int = 300, repeats: int = 7, seed: int = 0
) -> list[dict]:
    """Median time of one forward of T random tree tokens (tree mask + LM head over all rows) over a filled cache.

    T = 1 is a plain decoding step (causal, no mask). Rows: {tree_tokens, ms, ratio}, ratio = ms / the T=1 time
    (or the first size's time when 1 is not measured).
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    cache = target.new_cache()
    target.forward(torch.randint(0, vocab, (cache_tokens,), generator=generator), cache)

    def forward_ms(tokens: int) -> float:
        ids = torch.randint(0, vocab, (tokens,), generator=generator)
        if tokens == 1:
            args = ()
        else:  # each node hangs under a random earlier one
            parents = torch.tensor([-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, tokens)])
            tree = DraftTree(ids, parents)
            visible = torch.cat([torch.ones(tokens, cache_tokens, dtype=torch.bool), tree.ancestor_mask()], dim=1)
            args = (cache_tokens + tree.depths, visible)
        times = []
        for _ in range(repeats + 1):  # the first run warms up kernels for this shape
            _sync(target.device)
            start = time.perf_counter()
            hidden, _ = target.forward(ids, cache, *args)
            target.logits(hidden)
            _sync(target.device)
            times.append(time.perf_counter() - start)
            truncate(cache, cache_tokens)
        return 1000 * statistics.median(times[1:])

    rows = [{"tree_tokens": t, "ms": forward_ms(t)} for t in tree_sizes]
    for row in rows:
        row["ratio"] = row["ms"] / rows[0]["ms"]
    return rows
