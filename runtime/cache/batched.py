"""``batched-sequence``: many sequences, each with a private dense history.

Capacity bounds the logical positions held by all sequences together; a fork is charged
its prefix. A step is split into spans (consecutive tokens of one sequence) and each span
is planned against its own sequence, so no sequence ever appears in another's window.
"""
from __future__ import annotations

from .base import CacheBase, IdPool, not_live
from .config import CacheConfig, CacheGeometry
from .errors import CacheRefused
from .base import require_count
from .sequence import (
    CacheUsage,
    SequenceAdmission,
    SequenceHistory,
    SequenceStepPlan,
    plan_spans,
    ring_slots,
)
from .step import ALLOWED, Step, Verdict, as_index


class BatchedSequenceCache(SequenceAdmission, CacheBase[SequenceStepPlan]):
    kind = "batched-sequence"

    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self._ids = IdPool(config.max_seqs)
        self._rows: dict[int, SequenceHistory] = {}
        self._held = 0

    # -- queries ----------------------------------------------------------------------
    def max_seqs(self) -> int | None:
        return self.config.max_seqs

    def live_seqs(self) -> tuple[int, ...]:
        return self._ids.live()

    def pos(self, seq_id: int) -> int:
        """Where the sequence's next token goes (= positions it holds)."""
        return self._row(seq_id).length

    def held(self) -> int:
        return self._held

    def new_seq_allocates(self) -> bool:
        # A sequence's id is its storage row, and every row spans the longest history.
        return self._ids.peek() >= self._rows_allocated()

    def _rows_allocated(self) -> int:
        """Storage rows held; without storage, every id handed out so far had a row."""
        return self._ids.high_water

    def free(self) -> int:
        return self.capacity - self._held

    def can_extend(self, seq_id: int, n: int) -> Verdict:
        """Whether the sequence may grow by ``n`` positions: room in the shared capacity."""
        require_count("n", n)
        if seq_id not in self._ids:
            return Verdict(not_live(seq_id).reason)
        if self._held + n > self.capacity:
            return Verdict(
                f"{n} more positions do not fit: {self._held} of {self.capacity} are held; "
                "wait for sequences to finish or raise the capacity"
            )
        return ALLOWED

    def can_rewind(self, seq_id: int, position: int) -> Verdict:
        if seq_id not in self._ids:
            return Verdict(not_live(seq_id).reason)
        return self._rows[seq_id].rewind_verdict(position, self.policies)

    def rewind_floor(self, seq_id: int) -> int:
        return self._row(seq_id).floor(self.policies)

    def usage(self) -> CacheUsage:
        layer_layout = self.policies.layer_layout
        physical = sum(ring_slots(self.policies, layer_layout, h) for h in self._rows.values())
        return CacheUsage(self._held, physical, self.capacity)

    # -- verbs ------------------------------------------------------------------------
    def seq_new(self) -> int:
        seq_id = self._ids.take()
        self._rows[seq_id] = SequenceHistory()
        self._drop_step()
        return seq_id

    def seq_rm(self, seq_id: int) -> None:
        row = self._row(seq_id)
        self._held -= row.length
        del self._rows[seq_id]
        self._ids.release(seq_id)
        self._drop_step()
        self._release_sequence(seq_id)

    def can_clone(self, src: int, upto: int) -> Verdict:
        if src not in self._ids:
            return Verdict(not_live(src).reason)
        row = self._rows[src]
        if as_index(upto) is None or not 0 < upto <= row.length:
            return Verdict(
                f"a fork of sequence {src} must keep 1..{row.length} positions, got {upto!r}"
            )
        floor = row.floor(self.policies)
        if upto < floor:
            return Verdict(
                f"sequence {src}'s sliding-window layers retain only positions from {floor} "
                f"on; fork at {floor} or later"
            )
        if self._held + upto > self.capacity:
            return Verdict(
                f"a fork of {upto} positions does not fit: {self._held} of {self.capacity} "
                "positions are held"
            )
        return self._ids.check_room()

    def seq_clone(self, src: int, upto: int) -> int:
        """A new sequence holding exactly positions ``[0, upto)`` of ``src``, or refuse."""
        verdict = self.can_clone(src, upto)
        if not verdict:
            raise CacheRefused(verdict.reason or "")
        upto = as_index(upto)
        dst = self._ids.take()
        self._rows[dst] = SequenceHistory(upto, self._rows[src].written)
        self._held += upto
        self._drop_step()
        self._fork_sequence(src, dst, upto)
        return dst

    def rewind(self, seq_id: int, position: int) -> None:
        verdict = self.can_rewind(seq_id, position)
        if not verdict:
            raise CacheRefused(verdict.reason or "")
        row = self._rows[seq_id]
        position = as_index(position)
        self._held -= row.length - position
        row.length = position
        self._drop_step()

    def clear(self) -> None:
        self._rows.clear()
        self._ids.clear()
        self._held = 0
        self._drop_step()
        self._clear_storage()

    # -- step -------------------------------------------------------------------------
    def _plan_step(self, step: Step) -> SequenceStepPlan:
        for seq_id in step.tokens_per_sequence():
            if seq_id not in self._ids:
                raise not_live(seq_id)
        if self._held + len(step) > self.capacity:
            raise CacheRefused(
                f"the step needs {len(step)} positions, {self.capacity - self._held} of "
                f"{self.capacity} are free; wait for sequences to finish or raise the capacity"
            )
        spans = plan_spans(step, self._rows, self.policies)
        return SequenceStepPlan(step, spans, self.policies.layer_layout)

    def _commit(self, plan: SequenceStepPlan) -> None:
        for sp in plan.spans:
            row = self._rows[sp.span.seq_id]
            self._held += sp.end - row.length
            row.commit(sp.end)

    def _abandon(self, plan: SequenceStepPlan) -> None:
        for sp in plan.spans:
            self._rows[sp.span.seq_id].mark_written(sp.end)

    # -- byte-layer hooks (run after the bookkeeping changed) ----------------------------
    def _release_sequence(self, seq_id: int) -> None:
        """Drop the storage of a removed sequence."""

    def _fork_sequence(self, src: int, dst: int, upto: int) -> None:
        """Give ``dst`` the storage of ``src``'s first ``upto`` positions."""

    def _clear_storage(self) -> None:
        """Drop all storage."""

    def _row(self, seq_id: int) -> SequenceHistory:
        if seq_id not in self._ids:
            raise not_live(seq_id)
        return self._rows[seq_id]
