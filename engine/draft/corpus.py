"""The corpus index: what the model itself wrote after the same words in other answers, for drafting where the
context (engine.draft.context) has nothing.

A small chat model says the same things in the same words across answers ("Here are some tips", "In conclusion,
..."), and its greedy replies to thousands of prompts are in the repository already: the self-distilled training
data (data/selfdistill/, replies the engine's plain decoding wrote). A suffix array over those replies, read
backwards, finds after every round the longest suffix of the text that a reply contains, and the tokens that most
often followed it there, where the replies that share the match mostly agree on them. Like the context's, its
chains are deterministic functions of the text, so verification treats them as any other draft (q = 1) and the
output never changes (docs/decoding.md, "Drafting from the model's own replies").
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..model.gguf_cache import cache_root
from .records import load_arrays

DEPTH = 32  # longest match looked for, in tokens: replies are sorted by their last DEPTH tokens only
VOTERS = 256  # occurrences of a match that vote on its continuation, evenly spread over them
DEFAULT_CORPUS = sorted((Path(__file__).resolve().parents[2] / "data" / "selfdistill").glob("*.npz"))
_BEFORE_START = -(1 << 40)  # below every token and separator: what precedes the stream's first token
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Match:
    """The occurrences of the text's longest suffix in the corpus: rows lo..hi-1 of the index, `length` tokens."""

    lo: int
    hi: int
    length: int


class CorpusIndex:
    """A suffix array over token sequences read backwards, so the text's end is a prefix to narrow down one
    token at a time. Sequences are joined with a distinct negative separator each: no match or continuation
    crosses from one reply into another.

    `ends[i]` is where, in the joined stream, the i-th suffix (in sorted order) of the reversed stream begins,
    i.e. the last token of the reply text it reads backwards from.
    """

    def __init__(self, sequences: Iterable[Sequence[int]], cache: bool = True):
        parts = []
        for i, seq in enumerate(sequences):
            seq = np.asarray(seq, dtype=np.int64)
            if seq.size and not 0 <= seq.min() <= seq.max() < 2**31:
                raise ValueError(f"corpus sequence {i}: token ids must be non-negative 32-bit integers")
            parts += [seq.astype(np.int32), np.array([-1 - i], dtype=np.int32)]
        self.stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        self.ends = _cached_ends(self.stream) if cache else _sorted_ends(self.stream)
        self._tokens, self._ends = memoryview(self.stream), memoryview(self.ends)

    @classmethod
    def from_files(cls, paths: Iterable[str | Path], cache: bool = True) -> "CorpusIndex":
        """The replies (not the prompts) of training-record files (engine.draft.records: `export`'s .npz)."""
        replies = []
        for path in paths:
            tokens, offsets, prompt_lens, _ = load_arrays(path)
            replies += [tokens[offsets[i] + p: offsets[i + 1]] for i, p in enumerate(prompt_lens)]
        if not replies:
            raise ValueError("the corpus is empty: give at least one record file with replies")
        return cls(replies, cache=cache)

    def __len__(self) -> int:
        return len(self.stream)

    @property
    def max_token(self) -> int:
        return int(self.stream.max(initial=-1))

    def match(self, text: Sequence[int]) -> Match:
        """The longest suffix of `text` (up to DEPTH tokens) that occurs in the corpus."""
        lo, hi, length = 0, len(self.ends), 0
        tokens, ends = self._tokens, self._ends
        for d in range(min(DEPTH, len(text))):
            def back(row: int, d: int = d) -> int:
                end = ends[row]
                return tokens[end - d] if end >= d else _BEFORE_START
            token = text[-1 - d]
            first = bisect.bisect_left(range(len(ends)), token, lo, hi, key=back)
            last = bisect.bisect_right(range(len(ends)), token, first, hi, key=back)
            if first == last:
                break
            lo, hi, length = first, last, d + 1
        return Match(lo, hi, length)

    def continuation(self, match: Match, max_tokens: int, min_share: float = 0.0) -> list[int]:
        """The tokens that most often followed the match, one at a time: each next token is the majority among
        the occurrences that agreed so far (up to VOTERS of them), while it has at least min_share of their votes,
        up to max_tokens or a reply's end."""
        if not match.length:
            return []
        stride = max(1, (match.hi - match.lo) // VOTERS)
        starts = [self._ends[row] + 1 for row in range(match.lo, match.hi, stride)]
        tokens, out = self._tokens, []
        for offset in range(max_tokens):
            # every separator votes alike: "the reply ends here"
            token, votes = Counter(max(tokens[s + offset], -1) for s in starts).most_common(1)[0]
            if token < 0 or votes < min_share * len(starts):  # the replies end here, or disagree
                break
            out.append(token)
            starts = [s for s in starts if tokens[s + offset] == token]
        return out


def _sorted_ends(stream: np.ndarray) -> np.ndarray:
    """The reversed stream's suffixes sorted by their first DEPTH tokens (prefix doubling: each round sorts by
    twice as many tokens, from the ranks of the last), as positions of the stream read backwards from."""
    n = len(stream)
    reverse = stream[::-1].astype(np.int64)
    rank = reverse - reverse.min(initial=0)
    order, width = np.argsort(rank, kind="stable"), 1
    while width < min(DEPTH, n):  # past n tokens every suffix differs from the others already
        following = np.full(n, -1, dtype=np.int64)
        following[: n - width] = rank[width:]
        key = rank * (max(n, int(rank.max()) + 1) + 2) + following + 1
        order = np.argsort(key)
        sorted_keys = key[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate([[0], np.cumsum(sorted_keys[1:] != sorted_keys[:-1])])
        width *= 2
    return (n - 1 - order).astype(np.int32)


def _cached_ends(stream: np.ndarray) -> np.ndarray:
    """_sorted_ends, kept under the cache folder by the stream's hash (building it takes seconds per million
    tokens; reading it back, milliseconds). A missing, damaged or mismatched file is rebuilt."""
    key = hashlib.sha256(stream.tobytes()).hexdigest()[:24]
    path = cache_root() / "corpus" / f"{key}-depth{DEPTH}.npy"
    try:
        ends = np.load(path, allow_pickle=False)
        if ends.dtype == np.int32 and ends.shape == stream.shape and (not len(ends) or 0 <= ends.min() <= ends.max()
                                                                       < len(ends)):
            return ends
    except (OSError, ValueError) as err:
        if path.exists():
            log.warning("rebuilding the corpus index: %s is unreadable (%s)", path, err)
    ends = _sorted_ends(stream)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, ends)
        os.replace(tmp, path)
    except OSError as err:  # a read-only home still decodes, only slower to start
        log.warning("could not keep the corpus index in %s: %s", path.parent, err)
    return ends
