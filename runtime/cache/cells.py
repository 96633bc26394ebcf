"""``batched-cell``: many sequences over one pool of per-token cells (llama.cpp style).

Invariants, kept by every operation:
  * a cell is free iff ``cell_pos[c] == -1`` iff ``refs[c] == 0``; ``refs[c]`` counts the
    sequences owning it (a fork shares cells instead of copying them);
  * each sequence's cells are listed in ascending position order (positions only grow
    within a sequence), so a rewind or a prefix fork is a cut of that list;
  * ``used`` counts occupied cells, every occupied cell lies below ``used_end``, and
    ``first_free`` is at or below the lowest free cell.

Positions of a sequence must only increase; gaps are allowed. A window here only narrows
the mask: nothing is evicted, so there is no rewind floor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .base import CacheBase, IdPool, not_live, require_count
from .config import CacheConfig, CacheGeometry
from .errors import CacheRefused, StepStateError
from .sequence import CacheUsage
from .step import ALLOWED, Step, Verdict, as_index


class _SeqCells:
    """The cells one sequence owns and their positions, ascending, in growable arrays."""

    __slots__ = ("cells", "positions", "n")

    def __init__(self, cells: Optional[np.ndarray] = None, positions: Optional[np.ndarray] = None):
        self.cells = cells if cells is not None else np.empty(16, np.int64)
        self.positions = positions if positions is not None else np.empty(16, np.int64)
        self.n = 0 if cells is None else len(cells)

    def append(self, cells: np.ndarray, positions: np.ndarray) -> None:
        need = self.n + len(cells)
        if need > len(self.cells):
            size = max(need, 2 * len(self.cells))
            self.cells = np.resize(self.cells, size)
            self.positions = np.resize(self.positions, size)
        self.cells[self.n : need] = cells
        self.positions[self.n : need] = positions
        self.n = need

    def cut(self, position: int) -> int:
        """Index of the first cell at or past ``position``."""
        return int(np.searchsorted(self.positions[: self.n], position))

    @property
    def next_pos(self) -> int:
        return int(self.positions[self.n - 1]) + 1 if self.n else 0

    def holds(self, position: int) -> bool:
        i = self.cut(position)
        return i < self.n and int(self.positions[i]) == position

    def held_cells(self) -> np.ndarray:
        return self.cells[: self.n]


@dataclass(frozen=True)
class CellStepPlan:
    """A declared step of the cell layout.

    ``cells[i]`` is where token i's K/V go; every layer reads cells ``[0, read_len)``.
    The mask inputs (``cell_pos``, ``owned``) describe the pool as it will be once the
    step's cells are written; they are valid while this step is the declared one.
    """

    step: Step
    cells: np.ndarray  # int64 [T], read-only
    read_len: int
    seqs: tuple[int, ...]  # distinct sequences of the step, first-seen order
    query_seq: np.ndarray  # int64 [T]: index into ``seqs`` of each token's sequence
    query_pos: np.ndarray  # int64 [T]
    layer_windows: tuple[int, ...]  # per layer; 0 = flat
    _cache: "CellCache" = field(repr=False, compare=False)
    _generation: int = field(repr=False, compare=False)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def _current(self) -> None:
        if self._cache.generation != self._generation:
            raise StepStateError("this cell step is no longer the declared one")

    @property
    def cell_pos(self) -> np.ndarray:
        """int64 [read_len]: each cell's position after the step, -1 where free."""
        if "pos" not in self._memo:
            self._current()
            pos = self._cache._cell_pos[: self.read_len].copy()
            pos[self.cells] = self.query_pos
            pos.flags.writeable = False
            self._memo["pos"] = pos
        return self._memo["pos"]

    @property
    def owned(self) -> np.ndarray:
        """bool [len(seqs), read_len]: which cells each step sequence owns after the step."""
        if "owned" not in self._memo:
            self._current()
            owned = np.zeros((len(self.seqs), self.read_len), dtype=bool)
            for k, seq_id in enumerate(self.seqs):
                owned[k, self._cache._seq_cells[seq_id].held_cells()] = True
            owned[self.query_seq, self.cells] = True
            owned.flags.writeable = False
            self._memo["owned"] = owned
        return self._memo["owned"]

    def _by_sequence(self) -> tuple[np.ndarray, np.ndarray]:
        """Every cell the step's sequences own after the step, grouped by sequence (in
        ``seqs`` order) and by position within each: ``(cells, keys)`` with
        ``keys = k * 2**32 + position`` ascending, k the sequence's index in ``seqs``."""
        if "by_seq" not in self._memo:
            self._current()
            order = np.argsort(self.query_seq, kind="stable")  # token order within a sequence
            split = np.cumsum(np.bincount(self.query_seq, minlength=len(self.seqs)))[:-1]
            cells, positions, counts = [], [], []
            for seq_id, step_cells, step_pos in zip(
                self.seqs, np.split(self.cells[order], split), np.split(self.query_pos[order], split)
            ):
                held = self._cache._seq_cells[seq_id]
                # The step's positions are newer than any the sequence holds: still sorted.
                cells += [held.held_cells(), step_cells]
                positions += [held.positions[: held.n], step_pos]
                counts.append(held.n + len(step_cells))
            index = np.repeat(np.arange(len(self.seqs), dtype=np.int64), counts)
            keys = (index << 32) + np.concatenate(positions)
            self._memo["by_seq"] = (np.concatenate(cells), keys)
        return self._memo["by_seq"]

    def mask(self, window: int) -> np.ndarray:
        """bool [T, read_len]: token i may attend cell j (host-side; built once per window).

        Token i sees the cells its sequence owns at positions ``(p_i - window, p_i]``
        (``[0, p_i]`` when ``window`` is 0). Built by searching each sequence's sorted
        cells, so the cost follows the cells attended, not ``T * read_len``.
        """
        key = ("mask", window)
        if key not in self._memo:
            cells, keys = self._by_sequence()
            base = self.query_seq << 32
            oldest = np.maximum(self.query_pos - window + 1, 0) if window else 0
            lo = np.searchsorted(keys, base + oldest)
            hi = np.searchsorted(keys, base + self.query_pos, side="right")
            rows, picks = _ragged(np.arange(len(self.step)), lo, hi)
            mask = np.zeros((len(self.step), self.read_len), dtype=bool)
            mask[rows, cells[picks]] = True
            mask.flags.writeable = False
            self._memo[key] = mask
        return self._memo[key]


def _ragged(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row ``rows[i]`` paired with each index in ``[lo[i], hi[i])``, flattened."""
    lengths = hi - lo
    ends = np.cumsum(lengths)
    flat = np.arange(int(ends[-1]) if len(ends) else 0)
    return np.repeat(rows, lengths), flat + np.repeat(lo - (ends - lengths), lengths)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class CellCache(CacheBase[CellStepPlan]):
    kind = "batched-cell"

    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self._ids = IdPool(config.max_seqs)
        self._windows = tuple(p.window for p in geometry.policies)
        self._reset_table()

    def _reset_table(self) -> None:
        n = self.capacity
        self._cell_pos = np.full(n, -1, dtype=np.int64)
        self._refs = np.zeros(n, dtype=np.int32)
        self._used = 0
        self._used_end = 0
        self._first_free = 0
        self._seq_cells: dict[int, _SeqCells] = {}

    # -- queries ----------------------------------------------------------------------
    def max_seqs(self) -> int | None:
        return self.config.max_seqs

    def live_seqs(self) -> tuple[int, ...]:
        return self._ids.live()

    def pos(self, seq_id: int) -> int:
        """One past the newest position the sequence holds (0 when it holds none)."""
        return self._seq(seq_id).next_pos

    def seq_len(self, seq_id: int) -> int:
        """Cells the sequence owns (differs from ``pos`` when its positions have gaps)."""
        return self._seq(seq_id).n

    def free_cells(self) -> int:
        return self.capacity - self._used

    def used_end(self) -> int:
        return self._used_end

    def rewind_floor(self, seq_id: int) -> int:
        self._seq(seq_id)
        return 0

    def can_extend(self, seq_id: int, n: int) -> Verdict:
        """Whether the sequence may grow by ``n`` tokens: that many free cells."""
        require_count("n", n)
        if seq_id not in self._ids:
            return Verdict(not_live(seq_id).reason)
        free = self.capacity - self._used
        if n > free:
            return Verdict(
                f"{n} more tokens need {n} cells, {free} of {self.capacity} are free; "
                "wait for sequences to finish or raise the capacity"
            )
        return ALLOWED

    # -- admission arithmetic: a shared prefix is stored once ------------------------------
    def sample_share(self, prompt_len: int, n: int) -> int:
        """Positions each of ``n`` samples of one prompt may grow to, so that together they
        never outgrow the capacity: the prompt's cells are shared, the rest split."""
        return prompt_len + (self.capacity - prompt_len) // n

    def footprint(self, prompt_len: int, n: int, final_len: int) -> int:
        """Cells ``n`` samples of a prompt hold once each reaches ``final_len``."""
        return prompt_len + n * (final_len - prompt_len)

    def can_rewind(self, seq_id: int, position: int) -> Verdict:
        if seq_id not in self._ids:
            return Verdict(not_live(seq_id).reason)
        if as_index(position) is None:
            return Verdict(f"rewind position must be a non-negative integer, got {position!r}")
        held = self._seq_cells[seq_id].next_pos
        if position > held:
            return Verdict(
                f"sequence {seq_id} holds positions up to {held}; rewind cannot grow it to {position}"
            )
        return ALLOWED

    def usage(self) -> CacheUsage:
        logical = sum(s.n for s in self._seq_cells.values())
        return CacheUsage(logical, self._used * self.n_layers, self.capacity)

    # -- verbs ------------------------------------------------------------------------
    def seq_new(self) -> int:
        seq_id = self._ids.take()
        self._seq_cells[seq_id] = _SeqCells()
        self._drop_step()
        return seq_id

    def seq_rm(self, seq_id: int) -> None:
        cells = self._seq(seq_id)
        self._release_cells(cells.held_cells())
        del self._seq_cells[seq_id]
        self._ids.release(seq_id)
        self._drop_step()
        self._release_sequence(seq_id)

    def rewind(self, seq_id: int, position: int) -> None:
        verdict = self.can_rewind(seq_id, position)
        if not verdict:
            raise CacheRefused(verdict.reason or "")
        seq = self._seq_cells[seq_id]
        cut = seq.cut(position)
        self._release_cells(seq.cells[cut : seq.n])
        seq.n = cut
        self._drop_step()

    def can_clone(self, src: int, upto: int) -> Verdict:
        if src not in self._ids:
            return Verdict(not_live(src).reason)
        seq = self._seq_cells[src]
        if as_index(upto) is None or not 0 < upto <= seq.next_pos:
            return Verdict(
                f"a fork of sequence {src} must end at 1..{seq.next_pos}, got {upto!r}"
            )
        if not seq.holds(upto - 1):
            return Verdict(
                f"sequence {src} holds no position {upto - 1}; a fork must end on a held position"
            )
        return self._ids.check_room()

    def seq_clone(self, src: int, upto: int) -> int:
        """A new sequence sharing exactly the cells of ``src`` below ``upto``, or refuse."""
        verdict = self.can_clone(src, upto)
        if not verdict:
            raise CacheRefused(verdict.reason or "")
        seq = self._seq_cells[src]
        cut = seq.cut(upto)
        dst = self._ids.take()
        self._seq_cells[dst] = _SeqCells(seq.cells[:cut].copy(), seq.positions[:cut].copy())
        self._refs[seq.cells[:cut]] += 1
        self._drop_step()
        self._fork_sequence(src, dst, upto)
        return dst

    def clear(self) -> None:
        self._ids.clear()
        self._reset_table()
        self._drop_step()
        self._clear_storage()

    # -- step -------------------------------------------------------------------------
    def _plan_step(self, step: Step) -> CellStepPlan:
        counts = step.tokens_per_sequence()
        for seq_id in counts:
            if seq_id not in self._ids:
                raise not_live(seq_id)
        free = self.capacity - self._used
        if len(step) > free:
            raise CacheRefused(
                f"the step needs {len(step)} cells, {free} of {self.capacity} are free; "
                "wait for sequences to finish or raise the capacity"
            )
        newest = {s: self._seq_cells[s].next_pos - 1 for s in counts}
        for seq_id, position in zip(step.seq_ids, step.positions):
            if position <= newest[seq_id]:
                raise CacheRefused(
                    f"sequence {seq_id} already holds position {newest[seq_id]}; "
                    f"position {position} must be newer (rewind first to rewrite history)"
                )
            newest[seq_id] = position
        cells = self._lowest_free(len(step))
        seqs = tuple(counts)
        index = {s: k for k, s in enumerate(seqs)}
        return CellStepPlan(
            step=step,
            cells=_readonly(cells),
            read_len=max(self._used_end, int(cells[-1]) + 1),
            seqs=seqs,
            query_seq=_readonly(np.fromiter((index[s] for s in step.seq_ids), np.int64, len(step))),
            query_pos=_readonly(np.asarray(step.positions, dtype=np.int64)),
            layer_windows=self._windows,
            _cache=self,
            _generation=self.generation + 1,  # declare_step bumps it once the plan is set
        )

    def _commit(self, plan: CellStepPlan) -> None:
        cells = plan.cells
        self._cell_pos[cells] = plan.query_pos
        self._refs[cells] = 1
        self._used += len(cells)
        self._used_end = max(self._used_end, plan.read_len)
        for k, seq_id in enumerate(plan.seqs):
            mine = plan.query_seq == k
            self._seq_cells[seq_id].append(cells[mine], plan.query_pos[mine])
        # The step took the lowest free cells, so none is free below its last one.
        self._first_free = int(cells[-1]) + 1

    def _abandon(self, plan: CellStepPlan) -> None:
        """Nothing was claimed: cells are claimed only when a step finishes."""

    # -- byte-layer hooks (run after the bookkeeping changed) ----------------------------
    # Cells are shared, not copied: a fork or a removal changes only the bookkeeping, so
    # most byte layers need none of these; they exist so every batched kind has the same.
    def _release_sequence(self, seq_id: int) -> None:
        """A sequence was removed (its unshared cells are free)."""

    def _fork_sequence(self, src: int, dst: int, upto: int) -> None:
        """``dst`` now shares ``src``'s cells below ``upto``."""

    def _clear_storage(self) -> None:
        """Every cell is free; byte layers may drop their pools."""

    # -- cell table ---------------------------------------------------------------------
    def _lowest_free(self, n: int) -> np.ndarray:
        """The ``n`` lowest free cells, ascending (the caller checked that n are free)."""
        start = self._first_free
        width = max(2 * n, 64)
        while True:
            window = self._cell_pos[start : start + width]
            found = np.flatnonzero(window < 0)
            if len(found) >= n or start + width >= self.capacity:
                return found[:n] + start
            width *= 4

    def _release_cells(self, cells: np.ndarray) -> None:
        if len(cells) == 0:
            return
        self._refs[cells] -= 1
        freed = cells[self._refs[cells] == 0]
        if len(freed) == 0:
            return
        self._cell_pos[freed] = -1
        self._used -= len(freed)
        self._first_free = min(self._first_free, int(freed.min()))
        if int(freed.max()) + 1 >= self._used_end:
            occupied = np.flatnonzero(self._cell_pos[: self._used_end] >= 0)
            self._used_end = int(occupied[-1]) + 1 if len(occupied) else 0

    def _seq(self, seq_id: int) -> _SeqCells:
        if seq_id not in self._ids:
            raise not_live(seq_id)
        return self._seq_cells[seq_id]
