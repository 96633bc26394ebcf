"""A step: the tokens of one forward, each with its sequence and position."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from .errors import InvalidStep

# Positions and ids travel as int32 on device; anything larger is a caller bug.
MAX_INDEX = 2**31 - 1


def _as_int_tuple(name: str, values: Iterable[object]) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool):
            raise InvalidStep(f"{name} must be integers, got {v!r}")
        try:
            i = int(v)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise InvalidStep(f"{name} must be integers, got {v!r}") from None
        if i != v:
            raise InvalidStep(f"{name} must be integers, got {v!r}")
        if not 0 <= i <= MAX_INDEX:
            raise InvalidStep(f"{name} must lie in [0, {MAX_INDEX}], got {i}")
        out.append(i)
    return tuple(out)


@dataclass(frozen=True)
class Span:
    """A maximal run of consecutive tokens of one sequence within a step."""

    seq_id: int
    start: int  # token index within the step
    count: int
    position: int  # position of the span's first token


@dataclass(frozen=True)
class Step:
    """One entry per token, in token order: which sequence it extends, at which position."""

    seq_ids: tuple[int, ...]
    positions: tuple[int, ...]

    def __post_init__(self) -> None:
        seq_ids = _as_int_tuple("sequence ids", self.seq_ids)
        positions = _as_int_tuple("positions", self.positions)
        if not seq_ids:
            raise InvalidStep("a step carries at least one token")
        if len(seq_ids) != len(positions):
            raise InvalidStep(
                f"a step needs one position per token: {len(seq_ids)} sequence ids, "
                f"{len(positions)} positions"
            )
        object.__setattr__(self, "seq_ids", seq_ids)
        object.__setattr__(self, "positions", positions)

    @classmethod
    def run(cls, position: int, count: int, seq_id: int = 0) -> "Step":
        """``count`` consecutive tokens of one sequence starting at ``position``."""
        return cls((seq_id,) * count, tuple(range(position, position + count)))

    def __len__(self) -> int:
        return len(self.seq_ids)

    def spans(self) -> tuple[Span, ...]:
        """Consecutive tokens of one sequence grouped; a sequence may appear twice."""
        spans = []
        start = 0
        ids = self.seq_ids
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[start]:
                spans.append(Span(ids[start], start, i - start, self.positions[start]))
                start = i
        return tuple(spans)

    def tokens_per_sequence(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for s in self.seq_ids:
            counts[s] = counts.get(s, 0) + 1
        return counts


@dataclass(frozen=True)
class Verdict:
    """The answer of a query verb: truthy when allowed, else falsy with the reason.

    A bare reason string would be truthy, so queries answer with this instead.
    """

    reason: Optional[str] = None

    def __bool__(self) -> bool:
        return self.reason is None


ALLOWED = Verdict()
