"""Test-side byte layers over each cache kind: scalar K/V slots that remember their position.

Each slot stores ``(position, value)`` as written. A read follows the declared plan (write
and read runs for the sequence layouts, cells and masks for the cell layout) and compares
the position each slot recorded with the logical position the plan says it holds; a
mismatch is a *stale read* (the slot was overwritten since). This is the shadow table
that proves no planned read touches an overwritten slot, independently of the planner's
own floor arithmetic.

``write_and_read(layer, values)`` is one layer's ``attend`` reduced to bookkeeping: token
i writes ``values[i]``, and the call returns, per token, the ``(position, value)`` pairs
its query attends, oldest first.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mlx_pte.runtime.cache import (
    BatchedSequenceCache,
    CellCache,
    FlatLayout,
    MaskKind,
    Run,
    RunPlan,
    SingleCache,
    Step,
)

Entry = Optional[tuple[int, Any]]  # (position written, value); None = never written
Attended = list[list[tuple[int, Any]]]


def visible(plan: RunPlan, i: int, j: int) -> bool:
    """Whether query i of the plan's step may see read row j (the byte-layer mask rule).

    Lower-right aligned: query i of T over S rows sees j <= i + S - T; a BAND also needs
    j >= i + S - T - window + 1. NONE (one query) sees every row.
    """
    diag = i + plan.read_len - plan.count
    if plan.mask is MaskKind.NONE:
        assert plan.count == 1, "an unmasked plan must carry one query"
        return True
    if plan.mask is MaskKind.CAUSAL:
        return j <= diag
    return diag - plan.window + 1 <= j <= diag


def rows_of(runs: Sequence[Run]) -> list[int]:
    return [r.start + k for r in runs for k in range(r.length)]


class StaleCounter:
    """Shared by the shadow kinds: the stale-read count and the read check."""

    stale_reads: int

    def _check(self, entry: Entry, position: int) -> None:
        if entry is None or entry[0] != position:
            self.stale_reads += 1


class _SequenceShadow(StaleCounter):
    """Storage per (sequence, layer): a growing list for flat layers, ``slots`` for rings."""

    def _init_shadow(self) -> None:
        self.stale_reads = 0
        self.stores: dict[int, list[list[Entry]]] = {}

    def _new_store(self) -> list[list[Entry]]:
        stores = []
        for layer in range(self.n_layers):
            layout = self.policies.layouts[self.policies.layer_layout[layer]]
            stores.append([] if isinstance(layout, FlatLayout) else [None] * layout.slots)
        return stores

    def _store(self, seq_id: int, layer: int) -> list[Entry]:
        if seq_id not in self.stores:
            self.stores[seq_id] = self._new_store()
        return self.stores[seq_id][layer]

    def read_plan(self, seq_id: int, layer: int, plan: RunPlan) -> list[Entry]:
        """The entries of ``plan``'s read runs, counting every stale one."""
        store = self._store(seq_id, layer)
        out = []
        for j, row in enumerate(rows_of(plan.read)):
            entry = store[row] if row < len(store) else None
            self._check(entry, plan.read_base + j)
            out.append(entry)
        return out

    def write_and_read(self, layer: int, values: Sequence[Any]) -> Attended:
        self.layer_geometry(layer)  # AttendError for a layer the model lacks
        out: Attended = []
        for span, plan in self.step_plan.runs_for_layer(layer):
            store = self._store(span.seq_id, layer)
            rows = rows_of(plan.write)
            assert len(rows) == span.count == plan.count
            for k, row in enumerate(rows):
                if row >= len(store):
                    store.extend([None] * (row + 1 - len(store)))
                store[row] = (plan.position + k, values[span.start + k])
            entries = self.read_plan(span.seq_id, layer, plan)
            assert len(entries) == plan.read_len
            for i in range(span.count):
                out.append(
                    [
                        (plan.read_base + j, e[1] if e else None)
                        for j, e in enumerate(entries)
                        if visible(plan, i, j)
                    ]
                )
        return out


class ShadowSingle(_SequenceShadow, SingleCache):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._init_shadow()

    def _clear_storage(self) -> None:
        self.stores.clear()


class ShadowBatched(_SequenceShadow, BatchedSequenceCache):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._init_shadow()

    def _release_sequence(self, seq_id: int) -> None:
        self.stores.pop(seq_id, None)

    def _fork_sequence(self, src: int, dst: int, upto: int) -> None:
        # Flat layers take the prefix only; rings whole, since slot = position mod slots.
        forked = []
        for layer, store in enumerate(self.stores.get(src) or self._new_store()):
            layout = self.policies.layouts[self.policies.layer_layout[layer]]
            forked.append(list(store[:upto] if isinstance(layout, FlatLayout) else store))
        self.stores[dst] = forked

    def _clear_storage(self) -> None:
        self.stores.clear()


class ShadowCells(StaleCounter, CellCache):
    """One pool per layer, one entry per cell; ``hooks`` logs the byte-layer hooks called."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.stale_reads = 0
        self.pools: list[list[Entry]] = [[None] * self.capacity for _ in range(self.n_layers)]
        self.hooks: list[tuple] = []

    def write_and_read(self, layer: int, values: Sequence[Any]) -> Attended:
        self.layer_geometry(layer)  # AttendError for a layer the model lacks
        plan = self.step_plan
        pool = self.pools[layer]
        for i, cell in enumerate(plan.cells):
            pool[int(cell)] = (plan.step.positions[i], values[i])
        mask = plan.mask(plan.layer_windows[layer])
        cell_pos = plan.cell_pos
        out: Attended = []
        for i in range(len(plan.step)):
            seen = []
            for j in map(int, mask[i].nonzero()[0]):
                self._check(pool[j], int(cell_pos[j]))
                seen.append((int(cell_pos[j]), pool[j][1] if pool[j] else None))
            out.append(sorted(seen, key=lambda pv: pv[0]))
        return out

    def _release_sequence(self, seq_id: int) -> None:
        self.hooks.append(("release", seq_id, self.free_cells()))

    def _fork_sequence(self, src: int, dst: int, upto: int) -> None:
        self.hooks.append(("fork", src, dst, upto, self.pos(dst)))

    def _clear_storage(self) -> None:
        self.hooks.append(("clear", self.free_cells()))


def feed(cache: Any, seq_id: int, position: int, values: Sequence[Any]) -> list[Attended]:
    """One finished step of consecutive tokens through every layer; per layer, what each
    token attended."""
    cache.declare_step(Step.run(position, len(values), seq_id))
    seen = [cache.write_and_read(layer, values) for layer in range(cache.n_layers)]
    cache.finish_step()
    return seen
