"""What one verification forward costs as the tree grows: the curve that decides how big a draft tree pays off.

A round costs drafting + one base forward over all tree nodes, and it pays back the mean accepted length tau
in tokens; a tree of T nodes is worth it only while tau grows faster than the forward's cost over a plain step. So
a drafted token earns its row only where it is right more often than a row costs in plain steps: `row_cost`
measures that price on the machine at hand (a few plain steps' worth of rows on two CPU cores, next to nothing on a
GPU), once per CPU, thread count and model shape, kept on disk.
"""
from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from pathlib import Path

import torch

from ..model.cache import truncate
from ..model.gguf_cache import cache_root
from ..model.placement import wait_for
from ..model.quant import QuantLinear
from ..model.target import Target
from ..draft.tree import DraftTree


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
            wait_for(target.device)
            start = time.perf_counter()
            hidden, _ = target.forward(ids, cache, *args)
            target.logits(hidden)
            wait_for(target.device)
            times.append(time.perf_counter() - start)
            truncate(cache, cache_tokens)
        return 1000 * statistics.median(times[1:])

    rows = [{"tree_tokens": t, "ms": forward_ms(t)} for t in tree_sizes]
    for row in rows:
        row["ratio"] = row["ms"] / rows[0]["ms"]
    return rows


log = logging.getLogger(__name__)
ROW_COST_SIZES = [1, 2, 4]  # a plain step and two small trees: the marginal row of the trees a round drafts
ROW_COST_CACHE = 64  # cached tokens under them: a short prefill, even for a large model on a CPU


def row_cost(target: Target) -> float:
    """What one more verified row costs, in plain steps, on this machine: the slope of the verification curve over
    its first rows, measured once per CPU, thread count and model shape (kept under the cache folder: later engines
    of the same shape on the same machine read it)."""
    key, path = _machine_key(target), cache_root() / "row-costs.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measured again
        known = {}
    if not isinstance(known.get(key), float):
        curve = verification_curve(target, ROW_COST_SIZES, ROW_COST_CACHE, repeats=5)
        known[key] = max(0.0, (curve[-1]["ratio"] - 1) / (curve[-1]["tree_tokens"] - 1))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known, indent=1, sort_keys=True))
        except OSError as err:
            log.info("the verified row's cost is not kept (%s): the next engine measures it again", err)
    return known[key]


def _machine_key(target: Target) -> str:
    """The CPU (or GPU), the thread count and what sets a forward's cost: the model's shape and weight types."""
    device = (torch.cuda.get_device_name(target.device) if target.device.type == "cuda"
              else f"{_cpu_name()}, {torch.get_num_threads()} threads")
    config = target.config
    shape = (f"{config.model_type} {config.num_hidden_layers}x{config.hidden_size}, vocab {config.vocab_size}, "
             f"fused {target.fused is not None}")
    kinds = sorted({m.kind for m in target.model.modules() if isinstance(m, QuantLinear)}) or [str(target.model.dtype)]
    return f"{device} | {shape} | {', '.join(kinds)}"


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
