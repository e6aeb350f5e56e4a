"""Reference implementations the tests hold the engine to, written apart from it: what sampling should draw from,
what one speculative round should commit, which nodes EAGLE-2's and EAGLE-1's trees should hold, what the int8
kernels compute, and the chi-square test that judges sampled counts against exact probabilities.

Plain Python over sorted lists and float64, written from the definitions rather than from engine/ or
transformers' code, so that a bug shared with the code under test is unlikely.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Hashable, Iterable, Sequence

import torch

# Each statistical test fails a correct engine with probability ALPHA (its false-alarm rate); the draws are seeded,
# so a run is deterministic and the rate is the chance that the chosen seeds are unlucky.
ALPHA = 1e-6
MIN_EXPECTED = 5.0  # cells expecting fewer draws are pooled, where the chi-square approximation holds


def target_probs(logits: Sequence[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The distribution plain sampling draws from: logits / temperature, keep the top_k largest (ties at the k-th
    value kept), then keep the likeliest tokens while the mass kept before each is below top_p, renormalise."""
    scaled = [float(x) / temperature for x in logits]
    ranked = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = set(ranked)
    if top_k > 0:
        kth = scaled[ranked[min(top_k, len(ranked)) - 1]]
        kept = {i for i in kept if scaled[i] >= kth}
    if top_p < 1.0:
        probs = _softmax(scaled, kept)
        nucleus, mass = set(), 0.0
        for i in (i for i in ranked if i in kept):
            if mass < top_p:
                nucleus.add(i)
                mass += probs[i]
        kept = nucleus
    return _softmax(scaled, kept)


def _softmax(scaled: list[float], kept: set[int]) -> list[float]:
    top = max(scaled[i] for i in kept)
    weights = [math.exp(scaled[i] - top) if i in kept else 0.0 for i in range(len(scaled))]
    total = sum(weights)
    return [w / total for w in weights]


def round_distribution(tokens: Sequence[int], parents: Sequence[int], node_probs: Sequence[Sequence[float]]) -> dict:
    """Exact probability of each token sequence one lossless round commits through a draft tree: the target's own
    law of the sequence (node_probs[n] is the target distribution after node n), stopped after the first token
    that no child of the current node drafted. A token drafted twice under one parent is its first child's."""
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(parents):
        if parent >= 0:
            children.setdefault(parent, {}).setdefault(int(tokens[node]), node)
    law: dict[tuple[int, ...], float] = {}

    def walk(node: int, prefix: tuple[int, ...], mass: float) -> None:
        drafted = children.get(node, {})
        for token, p in enumerate(node_probs[node]):
            if p > 0 and token in drafted:
                walk(drafted[token], prefix + (token,), mass * p)
            elif p > 0:
                law[prefix + (token,)] = mass * p

    walk(0, (), 1.0)
    return law


def chi_square_pvalue(observed: Iterable[Hashable], expected: dict) -> float:
    """Pearson's chi-square p-value of draws against exact probabilities; 0.0 if a draw has probability 0."""
    counts = Counter(observed)
    draws = sum(counts.values())
    if any(expected.get(outcome, 0.0) <= 0 for outcome in counts):
        return 0.0
    cells: list[tuple[float, int]] = []
    pool_e = pool_o = 0.0
    for outcome, p in sorted(expected.items(), key=lambda item: item[1]):
        pool_e, pool_o = pool_e + p * draws, pool_o + counts.get(outcome, 0)
        if pool_e >= MIN_EXPECTED:
            cells.append((pool_e, pool_o))
            pool_e = pool_o = 0.0
    if pool_e > 0 and cells:  # a remainder too small to stand alone joins the smallest cell above it
        e, o = cells.pop()
        cells.append((e + pool_e, o + pool_o))
    if len(cells) < 2:
        return 1.0
    statistic = sum((o - e) ** 2 / e for e, o in cells)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def uniformity_pvalue(values: Sequence[float], bins: int = 10) -> float:
    """Chi-square p-value that `values` in [0, 1) are uniform, over equal bins."""
    observed = [min(int(v * bins), bins - 1) for v in values]
    return chi_square_pvalue(observed, {b: 1 / bins for b in range(bins)})


def randomized_pit(token: int, probs: Sequence[float], u: float) -> float:
    """Probability integral transform of a draw from a discrete law, made continuous by u ~ U(0, 1): uniform on
    [0, 1) when token was drawn from probs, whatever probs is, and independent of earlier draws' values. Tokens
    are laid out likeliest first, so a sampler that favours or shuns the likely tokens (what a speculative bug
    does) piles values near 0 or away from it in every context alike."""
    above = sum(p for t, p in enumerate(probs) if p > probs[token] or (p == probs[token] and t < token))
    return above + u * probs[token]


def drafted_frequency_pvalue(drafts: Sequence[tuple[bool, float]]) -> float:
    """Two-sided p-value that deterministic drafts were drawn as often as the target law says: each entry is
    (whether the sampled token was the drafted one, the drafted token's target probability). Lossless sampling
    outputs a drafted token x with probability p(x) exactly; a sampler that favours drafts (say, drawing the
    bonus from the whole law after rejecting x) outputs it more often. A normal approximation, its variance the
    sum of p(1 - p) (an upper bound when a round drafts several siblings, whose indicators exclude each other)."""
    excess = sum(float(hit) - p for hit, p in drafts)
    variance = sum(p * (1 - p) for _, p in drafts)
    return math.erfc(abs(excess) / math.sqrt(2 * variance)) if variance else 1.0


LogProbs = Callable[[tuple[int, ...]], Sequence[float]]  # draft log-probs over draft ids after a token path


def dynamic_tree_reference(
    log_probs: LogProbs, to_target: Callable[[int], int], top_k: int, depth: int, total_tokens: int
) -> dict[tuple[int, ...], float]:
    """EAGLE-2 by brute force over token paths: the root's top_k children start the beam; each of `depth` steps
    scores every beam node's top_k children by cumulative log-prob and keeps the top_k as the next beam; the tree
    is the total_tokens - 1 best-scored of all children met. Returns {token path: cumulative log-prob}."""

    def children(path: tuple[int, ...], score: float) -> list[tuple[tuple[int, ...], float]]:
        lp = log_probs(path)
        ranked = sorted(range(len(lp)), key=lambda d: -lp[d])[:top_k]
        return [(path + (to_target(d),), score + float(lp[d])) for d in ranked]

    beam = children((), 0.0)
    met = list(beam)
    for _ in range(depth):
        grown = [child for path, score in beam for child in children(path, score)]
        met += grown
        beam = sorted(grown, key=lambda c: -c[1])[:top_k]
    return dict(sorted(met, key=lambda c: -c[1])[: total_tokens - 1])


def static_tree_reference(
    log_probs: LogProbs, to_target: Callable[[int], int], paths: Sequence[Sequence[int]]
) -> dict[tuple[int, ...], tuple[int, ...]]:
    """EAGLE-1's fixed tree by definition: the node at ranks (r1, ..., rj) holds the rj-th likeliest draft after the
    tokens of the node at (r1, ..., rj-1). Returns {rank path: token path}."""
    tokens_at: dict[tuple[int, ...], tuple[int, ...]] = {(): ()}
    for ranks in sorted(map(tuple, paths), key=len):
        above = tokens_at[ranks[:-1]]
        lp = log_probs(above)
        tokens_at[ranks] = above + (to_target(sorted(range(len(lp)), key=lambda d: -lp[d])[ranks[-1]]),)
    del tokens_at[()]
    return tokens_at


def node_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[tuple[int, ...]]:
    """Each node's drafted tokens from the root's first child down to the node itself (the root's is empty)."""
    paths: list[tuple[int, ...]] = []
    for node, parent in enumerate(parents):
        paths.append(() if parent < 0 else paths[parent] + (int(tokens[node]),))
    return paths


def int8_reference(x: torch.Tensor, groups, bias: torch.Tensor | None) -> torch.Tensor:
    """What the int8 kernels define, in torch: each row's groups of 32 rounded to int8 (d = max|x| / 127, half to
    even), exact integer dot products (one per group, or one per 16 weights where the type has a scale each), then
    per output feature group after group acc + sum * (dw * d) (with mins: mins + mw * (d * s)), then acc (+ mins)
    (+ bias)."""
    rows, count, out = x.shape[0], x.shape[1] // 32, groups.codes.shape[0]
    parts = 2 if groups.halves else 1
    xg = x.view(rows, count, 32)
    d = xg.abs().amax(-1) / 127
    q = torch.round(xg * torch.where(d != 0, 1 / d, torch.zeros_like(d))[..., None]).long()
    w = groups.integers().long().view(out, count, parts, -1)
    sums = torch.einsum("rgpj,fgpj->rfgp", q.view(rows, count, parts, -1), w).float()  # exact: small integers
    scales = groups.scales.view(out, count, parts)
    ds = d * q.sum(-1).float()
    acc, mins = torch.zeros(rows, out), torch.zeros(rows, out)
    for g in range(count):
        if parts == 1:
            acc = acc + sums[:, :, g, 0] * (scales[None, :, g, 0] * d[:, None, g])
        else:
            for p in range(parts):
                acc = acc + sums[:, :, g, p] * (scales[None, :, g, p] * d[:, None, g])
        if groups.mins is not None:
            mins = mins + groups.mins[None, :, g] * ds[:, None, g]
    result = acc + mins if groups.mins is not None else acc
    return result if bias is None else result + bias
