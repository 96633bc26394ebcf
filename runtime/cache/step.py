"""A step: the tokens of one forward, each with its sequence and position."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, Optional

from .errors import AttendError, InvalidStep

# Positions and ids travel as int32 on device; anything larger is a caller bug.
MAX_INDEX = 2**31 - 1


def integer(value: object) -> Optional[int]:
    """``value`` as a Python int if it is an integer of any kind (Python, numpy, 0-d
    integer tensor), else None. Bools and floats are not integers here."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_index(value: object) -> Optional[int]:
    """``value`` as an int in ``[0, MAX_INDEX]`` (an id, position or count), else None."""
    i = integer(value)
    return i if i is not None and 0 <= i <= MAX_INDEX else None


def require_layer(layer: object, n_layers: int) -> int:
    """``layer`` as an index into ``n_layers`` cache layers, else AttendError."""
    i = integer(layer)
    if i is None or not 0 <= i < n_layers:
        raise AttendError(
            f"cache layer {layer!r} does not exist; the model has cache layers 0..{n_layers - 1}"
        )
    return i


def _as_int_tuple(name: str, values: Iterable[object]) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:
        raise InvalidStep(f"{name} must be a sequence of integers, got {values!r}") from None
    # Plain ints in range, what the engine passes every step: checked without a call each.
    if all(type(v) is int for v in items) and (not items or (min(items) >= 0 and max(items) <= MAX_INDEX)):
        return items
    out = []
    for v in items:
        i = as_index(v)
        if i is None:
            raise InvalidStep(f"{name} must be integers in [0, {MAX_INDEX}], got {v!r}")
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
