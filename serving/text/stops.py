"""Stop strings, checked incrementally as text is generated.

Each stop string runs a Knuth–Morris–Pratt matcher over the generated text, one
character at a time, so a token's piece costs O(len(piece)) amortized per stop string
and the text is never rescanned. The matcher's state is the longest suffix of the text
that is a prefix of the stop string: exactly the tail to hold back while streaming.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Bounds on what a request may ask for; the server answers 400 past them.
MAX_STOPS = 4
MAX_STOP_CHARS = 1000


class StopStringError(ValueError):
    """Stop strings that cannot be used; the message says which bound was passed."""


@dataclass(frozen=True)
class StopStrings:
    """A request's validated stop strings with their KMP failure tables (shared by its samples)."""

    strings: tuple[str, ...]
    failures: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, stops: Sequence[str]) -> "StopStrings":
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            raise StopStringError(f"stop must be a sequence of non-empty strings, got {stops!r}")
        if len(stops) > MAX_STOPS:
            raise StopStringError(f"at most {MAX_STOPS} stop strings are allowed, got {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise StopStringError(
                f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}")
        strings = tuple(dict.fromkeys(stops))  # duplicates change nothing
        return cls(strings, tuple(_failure(s) for s in strings))

    def __bool__(self) -> bool:
        return bool(self.strings)


def _failure(pattern: str) -> tuple[int, ...]:
    """KMP failure function: f[i] = length of the longest proper border of pattern[:i + 1]."""
    f = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = f[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        f[i] = k
    return tuple(f)


class StopText:
    """Text released as it is generated, cut before the first stop string.

    Holds back any tail that could still grow into a stop string, so streamed text
    never shows part of one. When a piece completes stop strings, the text is cut at
    the earliest start among them.
    """

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self.text = ""
        self.released = 0
        self.stopped = False
        self._matched = [0] * len(stops.strings)  # per stop: chars of it that end the text

    def push(self, piece: str) -> str:
        """Add decoded text; return what is now safe to show."""
        start = len(self.text)
        self.text += piece
        cut = None
        for j, (stop, failure) in enumerate(zip(self.stops.strings, self.stops.failures)):
            k = self._matched[j]
            for i, char in enumerate(piece):
                while k and char != stop[k]:
                    k = failure[k - 1]
                if char == stop[k]:
                    k += 1
                if k == len(stop):  # the first occurrence of this stop: it ends at start + i
                    begin = start + i + 1 - len(stop)
                    cut = begin if cut is None else min(cut, begin)
                    break
            self._matched[j] = k
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self.flush()
        hold = max(self._matched, default=0)
        end = max(self.released, len(self.text) - hold)
        out = self.text[self.released : end]
        self.released = end
        return out

    def flush(self) -> str:
        out = self.text[self.released :]
        self.released = len(self.text)
        return out
