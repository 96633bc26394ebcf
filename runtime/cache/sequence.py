"""Sequence layouts: one private, dense history per sequence.

Shared by ``single`` (one sequence) and ``batched-sequence`` (many). A history is dense
from position 0: its ``length`` is both what it holds and where its next token goes.
``written`` is the high-water mark of positions ever written: a rewind never lowers it,
a fork inherits it, and it bounds how far back a ring layer can resume (see
``RingLayout.retained_from``). Invariant: ``0 <= length <= written``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping

from .base import CacheBase, not_live, require_count
from .config import CacheConfig, CacheGeometry
from .errors import CacheRefused
from .plans import PolicyTable, RingLayout, RunPlan
from .step import ALLOWED, Span, Step, Verdict, as_index, require_layer


@dataclass
class SequenceHistory:
    length: int = 0
    written: int = 0

    def floor(self, table: PolicyTable) -> int:
        return table.floor(self.written)

    def rewind_verdict(self, position: object, table: PolicyTable) -> Verdict:
        if as_index(position) is None:
            return Verdict(f"rewind position must be a non-negative integer, got {position!r}")
        if position > self.length:
            return Verdict(
                f"the sequence holds {self.length} positions; rewind cannot grow it to {position}"
            )
        floor = self.floor(table)
        if position < floor:
            return Verdict(
                f"a sliding-window layer retains only positions from {floor} on; "
                f"rewind to {floor} or later"
            )
        return ALLOWED

    def commit(self, end: int) -> None:
        self.length = end
        self.written = max(self.written, end)

    def mark_written(self, end: int) -> None:
        """A failed step may still have overwritten ring slots up to ``end``."""
        self.written = max(self.written, end)


@dataclass(frozen=True)
class SpanPlan:
    """One span of a step planned on every distinct layout (``runs[i]`` for layout i)."""

    span: Span
    runs: tuple[RunPlan, ...]

    @property
    def end(self) -> int:
        return self.span.position + self.span.count


@dataclass(frozen=True)
class SequenceStepPlan:
    """A declared step of a sequence layout: its spans, in token order."""

    step: Step
    spans: tuple[SpanPlan, ...]
    layer_layout: tuple[int, ...]

    def runs_for_layer(self, layer: int) -> tuple[tuple[Span, RunPlan], ...]:
        """Each span with its plan on ``layer``'s layout, in token order."""
        index = self.layer_layout[require_layer(layer, len(self.layer_layout))]
        return tuple((sp.span, sp.runs[index]) for sp in self.spans)


def plan_spans(
    step: Step, histories: Mapping[int, SequenceHistory], table: PolicyTable
) -> tuple[SpanPlan, ...]:
    """Plan each span of ``step`` against its sequence's history; CacheRefused if any fails.

    Each span must continue its sequence: from its length, or from where its previous
    span in this step ended. Ring layers take at most ``max_write`` tokens per sequence.
    """
    running: dict[int, int] = {}
    plans = []
    limit = table.smallest_max_write
    positions = step.positions
    for span in step.spans():
        seq_id, start, count = span.seq_id, span.start, span.count
        length = histories[seq_id].length
        expected = running.get(seq_id, length)
        got = positions[start : start + count]
        # Decode spans (one token) skip building the expected range.
        if got[0] != expected or (count > 1 and got != tuple(range(expected, expected + count))):
            shown = list(got) if len(got) <= 8 else f"[{got[0]}, ..., {got[-1]}]"
            raise CacheRefused(
                f"sequence {seq_id} continues at position {expected}, but the step "
                f"gives it positions {shown}; rewind first to rewrite history"
            )
        running[seq_id] = end = expected + count
        if limit is not None and end - length > limit:
            raise CacheRefused(
                f"sequence {seq_id} writes {end - length} tokens in one step, "
                f"but sliding-window layers take at most {limit} (max_write); "
                "split the step into smaller chunks"
            )
        plans.append(SpanPlan(span, table.plan(expected, count)))
    return tuple(plans)


def ring_slots(table: PolicyTable, layer_layout: tuple[int, ...], history: SequenceHistory) -> int:
    """Physical rows a history occupies, summed over layers."""
    total = 0
    for index in layer_layout:
        layout = table.layouts[index]
        if isinstance(layout, RingLayout):
            total += min(history.written, layout.slots)
        else:
            total += history.length
    return total


@dataclass(frozen=True)
class CacheUsage:
    """How full a cache is.

    ``logical_positions``: positions held, summed over sequences (a fork counts its
    prefix; this is what capacity charges in the sequence layouts).
    ``physical_slots``: K/V rows that hold live data, summed over layers (cells count
    once however many sequences share them; a ring counts at most its slots).
    """

    logical_positions: int
    physical_slots: int
    capacity: int


class SequenceAdmission:
    """Admission arithmetic of the sequence layouts: every sequence, forks included, is
    charged its whole history."""

    def sample_share(self, prompt_len: int, n: int) -> int:
        """Positions each of ``n`` samples of one prompt may grow to, so that together they
        never outgrow the capacity."""
        return self.capacity // n  # type: ignore[attr-defined]

    def footprint(self, prompt_len: int, n: int, final_len: int) -> int:
        """Capacity units ``n`` samples of a prompt hold once each reaches ``final_len``."""
        return n * final_len


# The second argument of a two-argument verb, left out: the old single face's one-argument form.
_OMITTED = object()


def legacy_single_call(verb: str, first: object, second: object) -> tuple[object, object]:
    """``(seq_id, value)`` of a single-cache call that may use the old one-argument form
    ``verb(value)`` (sequence 0 implied), which still works but warns."""
    if second is not _OMITTED:
        return first, second
    warnings.warn(
        f"{verb}(value) on a single cache is deprecated: name the sequence, {verb}(0, value), "
        "as on every kind",
        DeprecationWarning,
        stacklevel=3,
    )
    return SingleCache.SEQ_ID, first


class SingleCache(SequenceAdmission, CacheBase[SequenceStepPlan]):
    """``single``: a batched cache of one implicit sequence (id 0), one length for all layers.

    Sequence 0 always exists: a forward needs no ``seq_new()``. ``seq_new()`` hands it out
    while it holds nothing (and refuses while it holds positions), ``seq_rm(0)`` empties it,
    forks are refused (there is no second sequence to fork into). Every verb takes the
    sequence id as on the batched kinds; ``pos()`` and ``rewind_floor()`` default to 0.
    """

    kind = "single"
    SEQ_ID = 0

    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self.history = SequenceHistory()

    # -- queries ----------------------------------------------------------------------
    def max_seqs(self) -> int:
        return 1

    def live_seqs(self) -> tuple[int, ...]:
        return (self.SEQ_ID,)

    def pos(self, seq_id: int = SEQ_ID) -> int:
        """Where the next token goes (= positions held)."""
        return self._history(seq_id).length

    def can_extend(self, seq_id: object = _OMITTED, n: object = _OMITTED) -> Verdict:
        """Whether the sequence has room for ``n`` more positions (``can_extend()``: one
        position of sequence 0; ``can_extend(n)``, the old one-argument form, warns)."""
        if seq_id is _OMITTED:
            seq_id, n = self.SEQ_ID, 1 if n is _OMITTED else n
        seq_id, n = legacy_single_call("can_extend", seq_id, n)
        require_count("n", n)
        if as_index(seq_id) is None or seq_id != self.SEQ_ID:
            return Verdict(not_live(seq_id).reason)
        if self.history.length + n > self.capacity:
            return Verdict(
                f"the sequence holds {self.history.length} of {self.capacity} positions; "
                f"{n} more do not fit (raise the capacity or rewind)"
            )
        return ALLOWED

    def can_rewind(self, seq_id: object, position: object = _OMITTED) -> Verdict:
        seq_id, position = legacy_single_call("can_rewind", seq_id, position)
        if seq_id != self.SEQ_ID or as_index(seq_id) is None:
            return Verdict(not_live(seq_id).reason)
        return self.history.rewind_verdict(position, self.policies)

    def rewind_floor(self, seq_id: int = SEQ_ID) -> int:
        return self._history(seq_id).floor(self.policies)

    def can_clone(self, src: int, upto: int) -> Verdict:
        return Verdict("the single layout holds one sequence, so it cannot fork; use a batched kind")

    def usage(self) -> CacheUsage:
        return CacheUsage(
            self.history.length,
            ring_slots(self.policies, self.policies.layer_layout, self.history),
            self.capacity,
        )

    # -- verbs ------------------------------------------------------------------------
    def seq_new(self) -> int:
        """Sequence 0, fresh, if it holds nothing; else CacheRefused."""
        if self.history.length:
            raise CacheRefused(
                f"the single layout's one sequence holds {self.history.length} positions; "
                "empty it with seq_rm(0) first, or use a batched kind for several sequences"
            )
        self.history = SequenceHistory()
        self._drop_step()
        return self.SEQ_ID

    def seq_rm(self, seq_id: int) -> None:
        """Empty sequence 0 (it always exists)."""
        self._history(seq_id)
        self.clear()

    def seq_clone(self, src: int, upto: int) -> int:
        raise CacheRefused(self.can_clone(src, upto).reason or "")

    def rewind(self, seq_id: object, position: object = _OMITTED) -> None:
        seq_id, position = legacy_single_call("rewind", seq_id, position)
        verdict = self.can_rewind(seq_id, position)
        if not verdict:
            raise CacheRefused(verdict.reason or "")
        self.history.length = as_index(position)
        self._drop_step()

    def clear(self) -> None:
        self.history = SequenceHistory()
        self._drop_step()
        self._clear_storage()

    def _history(self, seq_id: object) -> SequenceHistory:
        if as_index(seq_id) is None or seq_id != self.SEQ_ID:
            raise not_live(seq_id)
        return self.history

    # -- step -------------------------------------------------------------------------
    def _plan_step(self, step: Step) -> SequenceStepPlan:
        if any(s != self.SEQ_ID for s in step.seq_ids):
            raise CacheRefused(
                f"the single layout holds one sequence, id {self.SEQ_ID}; "
                "use a batched kind for several"
            )
        end = self.history.length + len(step)
        if end > self.capacity:
            raise CacheRefused(
                f"the step needs positions up to {end}, but capacity is {self.capacity} "
                f"({self.history.length} held); raise the capacity or rewind"
            )
        spans = plan_spans(step, {self.SEQ_ID: self.history}, self.policies)
        return SequenceStepPlan(step, spans, self.policies.layer_layout)

    def _commit(self, plan: SequenceStepPlan) -> None:
        self.history.commit(plan.spans[-1].end)

    def _abandon(self, plan: SequenceStepPlan) -> None:
        self.history.mark_written(plan.spans[-1].end)

    def _clear_storage(self) -> None:
        """Byte layers drop what they hold."""
