"""Finished sequences kept in the cache so later prompts that share their prefix skip it.

The store holds cache sequence ids with the token ids each one holds (position ``i`` of
the sequence is ``tokens[i]``), least recently used first, and knows nothing else about
the cache: the engine decides when an entry must go (``evict_lru``) and frees it through
``release``. Matching is a longest-common-prefix scan over the entries with numpy: a
store of tens of thousands of tokens answers in well under a millisecond
(``bench/prompt_store.py``), which is small next to one forward, so no trie is kept.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Retained:
    """One finished sequence the cache still holds."""

    seq_id: int
    tokens: np.ndarray  # int64 [length]: the token at each position
    prompt_len: int  # leading tokens that were its request's prompt; the rest is its reply

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Match:
    entry: Retained
    length: int  # leading tokens the prompt shares with the entry


class PromptStore:
    """A bounded LRU of retained sequences, keyed by their tokens.

    Args:
        budget: the most tokens all entries hold together; 0 keeps nothing.
        release: frees an entry's sequence in the cache (called on every eviction).
    """

    def __init__(self, budget: int, release: Callable[[int], None]) -> None:
        if budget < 0:
            raise ValueError(f"the prompt store's budget must be >= 0 tokens, got {budget}")
        self.budget = budget
        self._release = release
        self._entries: OrderedDict[int, Retained] = OrderedDict()  # by seq id, oldest first
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Retained]:
        return iter(self._entries.values())

    def __contains__(self, entry: object) -> bool:
        return isinstance(entry, Retained) and self._entries.get(entry.seq_id) is entry

    def matches(self, prompt: Sequence[int]) -> list[Match]:
        """Entries sharing at least one leading token with ``prompt``, longest share first
        (ties: most recently used first). A match never covers the prompt's last token:
        its logits are needed, so at least one token is always computed."""
        limit = len(prompt) - 1
        if limit < 1 or not self._entries:
            return []
        query = np.asarray(prompt[:limit], dtype=np.int64)
        found = []
        for entry in reversed(self._entries.values()):
            k = min(limit, len(entry))
            differ = np.flatnonzero(entry.tokens[:k] != query[:k])
            length = int(differ[0]) if len(differ) else k
            if length:
                found.append(Match(entry, length))
        found.sort(key=lambda m: -m.length)  # stable: recency breaks ties
        return found

    def touch(self, entry: Retained) -> None:
        """Mark ``entry`` as just used."""
        self._entries.move_to_end(entry.seq_id)

    def add(self, seq_id: int, tokens: Sequence[int], prompt_len: int) -> None:
        """Keep sequence ``seq_id`` (holding ``tokens``, the first ``prompt_len`` of them its
        prompt), or release it at once if it alone exceeds the budget or is a prefix of an
        entry (which then counts as used: it serves every prompt the new one would).
        Entries that are prefixes of it go, then the oldest until the budget holds."""
        new = Retained(seq_id, np.asarray(tokens, dtype=np.int64), prompt_len)
        longer = next((e for e in self._entries.values() if _is_prefix(new.tokens, e.tokens)), None)
        if longer is not None or not 0 < len(new) <= self.budget:
            if longer is not None:
                self.touch(longer)
            self._release(seq_id)
            return
        for old in [e for e in self._entries.values() if _is_prefix(e.tokens, new.tokens)]:
            self._drop(old)
        self._entries[seq_id] = new
        self.tokens += len(new)
        while self.tokens > self.budget:
            self.evict_lru()

    def take(self, entry: Retained) -> int:
        """Remove ``entry`` without releasing its sequence, which the caller now owns."""
        del self._entries[entry.seq_id]
        self.tokens -= len(entry)
        return entry.seq_id

    def evict_lru(self, keep: Optional[Retained] = None) -> bool:
        """Release the least recently used entry other than ``keep``; False if none."""
        for entry in self._entries.values():
            if entry is not keep:
                self._drop(entry)
                return True
        return False

    def clear(self) -> None:
        while self.evict_lru():
            pass

    def _drop(self, entry: Retained) -> None:
        self._release(self.take(entry))


def _is_prefix(short: np.ndarray, long: np.ndarray) -> bool:
    return len(short) <= len(long) and bool(np.array_equal(short, long[: len(short)]))
