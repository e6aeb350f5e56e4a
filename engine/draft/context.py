"""The context index: what followed the longest earlier match of the text's end, for drafting without a head,
and the policy (ContextDraft) that turns its continuations into a round's draft chains.

Much of what a chat model writes is already in its context (code being edited, names and numbers being
extracted, a sentence it repeats). A suffix automaton over the prompt and the generated tokens finds, after every
round, the longest suffix of the text that occurred before (any length, not a fixed n-gram size), and which tokens
followed it there, how often and how recently. Candidates read off it are deterministic functions of the context,
so verification treats them like any other draft (q = 1): drafting from the context never changes the output.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable

from .corpus import CorpusIndex


@dataclass(frozen=True)
class Continuation:
    """Tokens that followed an earlier occurrence of the text's end, and how far to trust them."""

    tokens: list[int]  # the predicted next tokens, first one first
    match_length: int  # how many of the text's last tokens that earlier occurrence shares
    count: int  # how many earlier occurrences of the match were followed by tokens[0]


class ContextIndex:
    """A suffix automaton over one growing token string (prompt, then generated tokens).

    Each state stands for a set of substrings with the same end positions; per state it keeps how many times they
    occur (`count`) and where they last ended (`end`), refreshed along the new token's suffix-link path. Building
    the automaton costs amortized O(1) per token; the refresh walks one state per class of repeated suffixes: a
    handful in ordinary text, up to the repeat's length while the text repeats one token over and over.
    """

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]
        self._link = [-1]
        self._length = [0]
        self._count = [0]
        self._end = [-1]
        self._last = 0  # the state of the whole text
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the text, in time proportional to their number (amortized)."""
        for token in tokens:
            try:
                token = operator.index(token)
            except TypeError:
                raise TypeError(f"context tokens must be integer ids, got {token!r}") from None
            if token < 0:
                raise ValueError(f"context tokens must be non-negative ids, got {token}")
            self._append(token)

    def continuations(self, max_tokens: int, max_branches: int = 1) -> list[Continuation]:
        """What followed the longest earlier match of the text's end: one continuation per distinct next token,
        most frequent first (then most recent), each copied from that token's latest occurrence, up to
        max_tokens long. Empty when the text's last token never occurred before."""
        if max_tokens < 1 or max_branches < 1:
            raise ValueError(f"max_tokens and max_branches must be at least 1, got {max_tokens}, {max_branches}")
        match = self._link[self._last]
        if match <= 0:  # no state, or the root: nothing of the text's end occurred before
            return []
        followers = sorted(self._next[match].values(), key=lambda s: (self._count[s], self._end[s]), reverse=True)
        return [
            Continuation(self._copy_from(self._end[s], max_tokens), self._length[match], self._count[s])
            for s in followers[:max_branches]
        ]

    def match_length(self) -> int:
        """How many of the text's last tokens occurred before (0: not even the last one)."""
        match = self._link[self._last]
        return self._length[match] if match > 0 else 0

    def _copy_from(self, start: int, max_tokens: int) -> list[int]:
        """tokens[start:], as many as asked; past the text's end the copy overlaps itself (text[n + i] is predicted
        as text[start + i]), so a repeating pattern keeps repeating instead of stopping at the end."""
        text, n = self.tokens, len(self.tokens)
        out: list[int] = []
        for i in range(max_tokens):
            out.append(text[start + i] if start + i < n else out[start + i - n])
        return out

    def _new_state(self, length: int, link: int, successors: dict[int, int], count: int, end: int) -> int:
        self._next.append(successors)
        self._link.append(link)
        self._length.append(length)
        self._count.append(count)
        self._end.append(end)
        return len(self._next) - 1

    def _append(self, token: int) -> None:
        """The standard online construction step (Blumer et al.), cloning a state when a transition is split."""
        position = len(self.tokens)
        self.tokens.append(token)
        cur = self._new_state(self._length[self._last] + 1, 0, {}, 0, position)
        p = self._last
        while p != -1 and token not in self._next[p]:
            self._next[p][token] = cur
            p = self._link[p]
        if p != -1:
            q = self._next[p][token]
            if self._length[p] + 1 == self._length[q]:
                self._link[cur] = q
            else:
                clone = self._new_state(self._length[p] + 1, self._link[q], dict(self._next[q]), self._count[q],
                                        self._end[q])
                while p != -1 and self._next[p].get(token) == q:
                    self._next[p][token] = clone
                    p = self._link[p]
                self._link[q] = self._link[cur] = clone
        self._last = cur
        self._record(cur, position)

    def _record(self, state: int, position: int) -> None:
        """Every suffix of the text now also ends at `position`: one more occurrence, the latest one."""
        while state > 0:
            self._count[state] += 1
            self._end[state] = position
            state = self._link[state]


MATCH_BUCKETS = 8  # matches of 8 tokens or more are counted together: their chains are right nearly always
KNOWN_AFTER = 8  # chains a match length and chain position need before their rate decides


@dataclass
class ChainAcceptance:
    """How often a context chain's first k tokens were all right, by the length of the match it continues, counted
    over the chains verified so far, and how long a chain pays from it where a verified row costs `row_cost` plain
    steps: each right token saves a plain step and each drafted one costs a row, so a chain runs up to its last
    position that is right at least that often (none where even its first token is right less often; the head then
    drafts the round). Positions not yet seen KNOWN_AFTER times keep ContextDraft's own length: on two CPU cores,
    where a row costs a fifth of a step or more, chains shrink to what pays; on a GPU they stay long."""

    row_cost: float
    drafted: dict[int, list[int]] = field(default_factory=dict)  # match -> per chain position, chains that reached it
    right: dict[int, list[int]] = field(default_factory=dict)  # ... and were right up to it

    def length(self, match: int, longest: int) -> int:
        """How many tokens of a chain continuing a `match`-token match to draft, at most `longest`."""
        bucket = min(match, MATCH_BUCKETS)
        drafted, right = self.drafted.get(bucket, []), self.right.get(bucket, [])
        for k in range(min(longest, len(drafted))):
            if drafted[k] >= KNOWN_AFTER and right[k] / drafted[k] < self.row_cost:
                return k
        return longest

    def observe(self, match: int, chain: list[int], committed: list[int]) -> None:
        """A verified chain and the tokens its round committed: which of its positions were right."""
        bucket = min(match, MATCH_BUCKETS)
        drafted = self.drafted.setdefault(bucket, [])
        right = self.right.setdefault(bucket, [])
        if len(drafted) < len(chain):
            drafted += [0] * (len(chain) - len(drafted))
            right += [0] * (len(chain) - len(right))
        agree = next((i for i, (a, b) in enumerate(zip(chain, committed)) if a != b), min(len(chain), len(committed)))
        for k in range(len(chain)):
            drafted[k] += 1
            right[k] += k < agree


@dataclass(frozen=True)
class ContextDraft:
    """Which continuations of the context a round drafts: chains under the tree's root, the longest match's
    continuation first and the others at half its length. A longer match earns a longer chain: on the shipped
    model's MT-bench answers the first continued token was right the more often the longer the match, nearly
    always after 8 or more tokens, and the accepted length grew about as fast as the match (docs/decoding.md,
    "Drafting from the context"). A 1-token match drafts nothing: its chains, right far less often than the head's
    first draft, took the round from it and cost more rows to verify.
    """

    tokens_per_match: float = 2.0  # chain length per matched token
    max_tokens: int = 16  # the longest chain, whatever the match
    branches: int = 2  # distinct continuations drafted (one chain each)
    min_match: int = 2  # shorter matches draft nothing
    # Where the context drafts nothing, one chain from the corpus (engine.draft.corpus): the tokens that at least
    # corpus_share of the replies sharing the text's end continued it with. On the shipped model's MT-bench answers
    # such a token was right far more often than one with less agreement; one token a round paid best on the CPU,
    # where each drafted row costs a good share of a plain step (docs/benchmarks.md, "Drafting from the context and
    # the corpus")
    corpus_share: float = 0.7
    corpus_max_tokens: int = 1
    # Cut each chain to what pays at this machine's cost of a verified row, from the chains verified so far
    # (ChainAcceptance, kept by the Engine); False: the lengths above as they are.
    sized: bool = True

    def __post_init__(self):
        counts = (self.max_tokens, self.branches, self.min_match, self.corpus_max_tokens)
        if self.tokens_per_match <= 0 or min(counts) < 1:
            raise ValueError("context drafting needs tokens_per_match > 0 and max_tokens, branches, min_match, "
                             "corpus_max_tokens >= 1")
        if not 0 <= self.corpus_share <= 1:
            raise ValueError(f"corpus_share is a fraction of the votes, between 0 and 1, got {self.corpus_share}")

    def chains(self, index: ContextIndex, corpus: CorpusIndex | None = None,
               acceptance: ChainAcceptance | None = None) -> list[list[int]]:
        """This round's chains, most trusted first; none when the text's end matches nothing long enough, in the
        context or (given) the corpus. acceptance: what the chains verified so far say pays (else this rule's
        lengths)."""
        found = index.continuations(self.max_tokens, self.branches)
        if found and found[0].match_length >= self.min_match:
            length = min(self.max_tokens, max(1, round(self.tokens_per_match * found[0].match_length)))
            if acceptance is not None:
                length = acceptance.length(found[0].match_length, length)
            if length == 0:
                return []
            return [found[0].tokens[:length]] + [c.tokens[: max(1, length // 2)] for c in found[1:]]
        chain = corpus.continuation(corpus.match(index.tokens), self.corpus_max_tokens,
                                    self.corpus_share) if corpus is not None else []
        return [chain] if chain else []
