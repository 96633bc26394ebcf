"""Random scripts of every verb against a brute-force model, for each cache kind.

The model keeps, per sequence, a dict position -> value (and, for the sequence layouts,
the high-water mark of positions written) and predicts every verdict from the rules of
neutral_cache.md. After each step the cache must agree on every query; a refused verb or
declaration must leave the whole cache (and its shadow storage) exactly as it was, with
the previous declaration standing; and every forward runs through the shadow store,
whose attended (position, value) pairs must equal the model's and whose stale-read
counter must stay 0 — so no planned read ever touches an overwritten ring slot.
"""
from __future__ import annotations

from typing import Any, Optional

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlx_pte.runtime.cache import CacheConfig, CacheRefused, Step

from .helpers import FLAT, geometry, ring, snapshot
from .shadow import ShadowBatched, ShadowCells, ShadowSingle

SETTINGS = settings(
    max_examples=30,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

POLICY_SETS = st.sampled_from(["flat", "ring", "flat+ring", "flat+two rings"])


class CacheMachine(RuleBasedStateMachine):
    """The model and the rules every kind shares; ``cells``/``single`` switch the rules
    that differ by kind, and ``SequenceRules`` adds the verbs that make and drop sequences
    (on ``single``: one implicit sequence, handed out while empty, emptied by seq_rm)."""

    shadow: type
    cells = False  # the cell layout: gaps allowed, forks share cells, no floor
    single = False

    # -- setup ----------------------------------------------------------------------
    @initialize(
        policy_set=POLICY_SETS,
        w1=st.integers(1, 4),
        w2=st.integers(1, 4),
        max_write=st.sampled_from([None, 1, 2, 3]),
        capacity=st.integers(8, 40),
        max_seqs=st.sampled_from([None, 4]),
        n_seqs=st.integers(1, 2),
    )
    def setup(self, policy_set, w1, w2, max_write, capacity, max_seqs, n_seqs):
        policies = {
            "flat": (FLAT,),
            "ring": (ring(w1),),
            "flat+ring": (FLAT, ring(w1)),
            "flat+two rings": (FLAT, ring(w1), ring(w2), ring(w1)),
        }[policy_set]
        self.windows = [p.window for p in policies]
        self.rings = [(p.window, max_write or p.window) for p in policies if p.is_ring]
        self.capacity = capacity
        self.max_seqs = None if self.single else max_seqs
        self.cache = self.shadow(
            geometry(*policies), CacheConfig(capacity, max_write=max_write, max_seqs=self.max_seqs)
        )
        self.seqs: dict[int, dict[int, Any]] = {0: {}} if self.single else {}
        self.written: dict[int, int] = {0: 0} if self.single else {}
        self.cell_of: dict[Any, int] = {}
        self.pending: Optional[tuple[Step, Any]] = None
        self.counter = 0
        for _ in range(0 if self.single else n_seqs):
            seq_id = self.cache.seq_new()
            self.seqs[seq_id] = {}
            self.written[seq_id] = 0

    # -- the model's rules ------------------------------------------------------------
    def next_pos(self, seq_id: int) -> int:
        held = self.seqs[seq_id]
        return max(held) + 1 if held else 0

    def floor(self, seq_id: int) -> int:
        if self.cells:
            return 0
        return max([0] + [self.written[seq_id] - m for _, m in self.rings])

    def occupied(self) -> set[int]:
        return {self.cell_of[v] for held in self.seqs.values() for v in held.values()}

    def step_ok(self, step: Step) -> bool:
        if any(s not in self.seqs for s in step.seq_ids):
            return False
        if self.cells:
            if len(step) > self.capacity - len(self.occupied()):
                return False
        elif sum(len(h) for h in self.seqs.values()) + len(step) > self.capacity:
            return False
        newest = {s: self.next_pos(s) - 1 for s in step.seq_ids}
        taken: dict[int, int] = {}
        for s, p in zip(step.seq_ids, step.positions):
            # Cells: strictly newer, gaps allowed. Sequence layouts: the very next position.
            fits = p > newest[s] if self.cells else p == newest[s] + 1
            if not fits:
                return False
            newest[s] = p
            taken[s] = taken.get(s, 0) + 1
        limit = min([m for _, m in self.rings], default=None)
        return self.cells or limit is None or max(taken.values()) <= limit

    def lowest_id(self) -> int:
        return min(set(range(len(self.seqs) + 1)) - set(self.seqs))

    def clone_ok(self, src: Any, upto: Any) -> bool:
        if src not in self.seqs or type(upto) is not int:
            return False
        held = self.seqs[src]
        if not 0 < upto <= self.next_pos(src) or upto < self.floor(src):
            return False
        if self.cells and upto - 1 not in held:
            return False
        if not self.cells and sum(len(h) for h in self.seqs.values()) + upto > self.capacity:
            return False
        return self.max_seqs is None or len(self.seqs) < self.max_seqs

    # -- helpers ------------------------------------------------------------------------
    def live_choice(self, data, negative: bool = True) -> Any:
        """Mostly a live id that holds positions, sometimes an empty or a dead one."""
        holding = [s for s in sorted(self.seqs) if self.seqs[s]]
        empty = [s for s in sorted(self.seqs) if not self.seqs[s]]
        bogus = [max(self.seqs, default=-1) + 1, 99] + ([-1] if negative else [])
        return data.draw(st.sampled_from(holding * 6 + empty * 2 + bogus))

    def position_choice(self, data, seq_id: Any) -> Any:
        if seq_id not in self.seqs:
            return data.draw(st.integers(0, 4))
        end, floor = self.next_pos(seq_id), self.floor(seq_id)
        return data.draw(st.sampled_from([-1, 0, 1, floor - 1, floor, end - 1, end, end + 1]))

    def attempt(self, verb, ok: bool) -> Any:
        """Run ``verb``; if refused, nothing may have changed."""
        before = snapshot(self.cache)
        plan = self.cache.step_plan if self.pending else None
        if ok:
            result = verb()
            self.pending = None
            assert not self.cache.is_declared
            return result
        try:
            verb()
        except CacheRefused as refused:
            assert refused.reason
        else:
            raise AssertionError("the cache accepted what the model refuses")
        assert snapshot(self.cache) == before
        assert self.cache.is_declared == (plan is not None)
        if plan is not None:
            assert self.cache.step_plan is plan
        return None

    def expected_reads(self, step: Step, values: list[int], window: int) -> list[list]:
        """Per token: (position, value) of everything its sequence holds in its window,
        this step's earlier tokens and itself included, oldest first."""
        tokens = list(zip(step.seq_ids, step.positions, values))
        out = []
        for i, (s, q, _) in enumerate(tokens):
            seen = dict(self.seqs[s])
            seen.update({p: v for s2, p, v in tokens[: i + 1] if s2 == s})
            lo = q - window + 1 if window else 0
            out.append(sorted((p, v) for p, v in seen.items() if lo <= p <= q))
        return out

    def draw_step(self, data) -> Step:
        """Mostly a step the model accepts; else one with a wrong id, position or size."""
        valid = data.draw(st.integers(0, 4)) > 0
        limit = min([m for _, m in self.rings], default=4)
        running: dict[Any, int] = {}
        taken: dict[Any, int] = {}
        ids: list[int] = []
        positions: list[int] = []
        for _ in range(data.draw(st.integers(1, 3))):
            if self.single:
                seq_id = 0 if valid else data.draw(st.sampled_from([0, 1]))
            elif valid and self.seqs:
                seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
            else:
                seq_id = self.live_choice(data, negative=False)
            room = limit - taken.get(seq_id, 0) if valid and not self.cells else 4
            if room <= 0:
                continue
            count = data.draw(st.integers(1, room if valid else room + 2))
            shifts = ([0, 0, 1, 3] if self.cells else [0]) if valid else [0, 1, -1, 2]
            start = running.get(seq_id, self.next_pos(seq_id) if seq_id in self.seqs else 0)
            start = max(0, start + data.draw(st.sampled_from(shifts)))
            ids += [seq_id] * count
            positions += range(start, start + count)
            running[seq_id] = start + count
            taken[seq_id] = taken.get(seq_id, 0) + count
        return Step(tuple(ids), tuple(positions))

    def check_cell_plan(self, step: Step, plan: Any) -> None:
        """The lowest free cells, in token order; the mask inputs as after the step."""
        free = sorted(set(range(self.capacity)) - self.occupied())[: len(step)]
        assert plan.cells.tolist() == free
        read_len = max(self.occupied() | set(free)) + 1
        assert plan.read_len == read_len
        cell_pos = [-1] * read_len
        owners: list[set] = [set() for _ in range(read_len)]
        for s, held in self.seqs.items():
            for p, v in held.items():
                cell_pos[self.cell_of[v]] = p
                owners[self.cell_of[v]].add(s)
        for s, p, cell in zip(step.seq_ids, step.positions, free):
            cell_pos[cell] = p
            owners[cell].add(s)
        assert plan.cell_pos.tolist() == cell_pos
        assert plan.owned.tolist() == [[s in o for o in owners] for s in plan.seqs]

    # -- rules ----------------------------------------------------------------------------
    def declare(self, data) -> bool:
        """Declare a drawn step; True if the model (and so the cache) accepted it."""
        step = self.draw_step(data)
        ok = self.step_ok(step)
        before = snapshot(self.cache)
        assert bool(self.cache.check_step(step)) == ok
        assert snapshot(self.cache) == before
        if not ok:
            self.attempt(lambda: self.cache.declare_step(step), ok=False)
            return False
        plan = self.cache.declare_step(step)
        assert self.cache.step_plan is plan
        if self.cells:
            self.check_cell_plan(step, plan)
        self.pending = (step, plan)
        return True

    @rule(data=st.data(), steps=st.integers(1, 3))
    def step(self, data, steps):
        """A few forwards in a row, so histories grow long enough to wrap their rings."""
        for _ in range(steps):
            if self.declare(data):
                self.forward(data, data.draw(st.integers(0, 3)) > 0)

    @rule(data=st.data())
    def declare_only(self, data):
        self.declare(data)

    @precondition(lambda self: self.pending is not None)
    @rule(data=st.data(), finish=st.booleans())
    def forward(self, data, finish):
        """Run the declared step through the shadow layers, then finish or abort it."""
        step, _ = self.pending
        values = list(range(self.counter, self.counter + len(step)))
        self.counter += len(step)
        every = list(range(len(self.windows)))
        layers = data.draw(st.permutations(every)) + data.draw(
            st.lists(st.sampled_from(every), max_size=2)
        )
        if not finish:
            layers = layers[: data.draw(st.integers(0, len(layers)))]
        for layer in layers:
            got = self.cache.write_and_read(layer, values)
            assert got == self.expected_reads(step, values, self.windows[layer])
        assert self.cache.stale_reads == 0
        self.pending = None
        if finish:
            if self.cells:
                for cell, v in zip(self.cache.step_plan.cells.tolist(), values):
                    self.cell_of[v] = cell
            self.cache.finish_step()
            for s, p, v in zip(step.seq_ids, step.positions, values):
                self.seqs[s][p] = v
                self.written[s] = max(self.written.get(s, 0), p + 1)
        else:
            self.cache.abort_step()
            for s, p in zip(step.seq_ids, step.positions):
                self.written[s] = max(self.written.get(s, 0), p + 1)
        assert not self.cache.is_declared

    @precondition(lambda self: any(self.seqs.values()))
    @rule(data=st.data())
    def rewind(self, data):
        seq_id = self.live_choice(data)
        position = self.position_choice(data, seq_id)
        ok = (seq_id in self.seqs and 0 <= position <= self.next_pos(seq_id)
              and position >= self.floor(seq_id))
        assert bool(self.cache.can_rewind(seq_id, position)) == ok
        self.attempt(lambda: self.cache.rewind(seq_id, position), ok)
        if ok:
            self.seqs[seq_id] = {p: v for p, v in self.seqs[seq_id].items() if p < position}

    @precondition(lambda self: 2 * self.cache.usage().logical_positions >= self.capacity)
    @rule()
    def clear(self):
        self.attempt(self.cache.clear, ok=True)
        self.seqs = {0: {}} if self.single else {}
        self.written = {0: 0} if self.single else {}

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        usage = cache.usage()
        held = sum(len(h) for h in self.seqs.values())
        assert usage.logical_positions == held
        assert usage.capacity == self.capacity
        assert cache.live_seqs() == tuple(sorted(self.seqs))
        assert cache.max_seqs() == (1 if self.single else self.max_seqs)
        room = self.capacity - (len(self.occupied()) if self.cells else held)
        for s in self.seqs:
            assert cache.pos(s) == self.next_pos(s)
            assert cache.rewind_floor(s) == self.floor(s)
            assert cache.can_extend(s, room) and not cache.can_extend(s, room + 1)
        if self.single:
            return
        if self.cells:
            occupied = self.occupied()
            assert cache.free_cells() == self.capacity - len(occupied)
            assert cache.used_end() == (max(occupied) + 1 if occupied else 0)
            for s, held in self.seqs.items():
                assert cache.seq_len(s) == len(held)
        else:
            assert cache.held() == sum(len(h) for h in self.seqs.values())


class SequenceRules(CacheMachine):
    """Making, dropping and forking sequences."""

    @precondition(lambda self: len(self.seqs) < 5)
    @rule()
    def seq_new(self):
        if self.single:  # the one sequence, while it holds nothing
            ok, expected = not self.seqs[0], 0
        else:
            ok = self.max_seqs is None or len(self.seqs) < self.max_seqs
            expected = self.lowest_id() if ok else None
        got = self.attempt(self.cache.seq_new, ok)
        if ok:
            assert got == expected
            self.seqs[got] = {}
            self.written[got] = 0

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def seq_rm(self, data):
        seq_id = self.live_choice(data)
        ok = seq_id in self.seqs
        self.attempt(lambda: self.cache.seq_rm(seq_id), ok)
        if ok and self.single:  # emptied, never gone
            self.seqs[seq_id], self.written[seq_id] = {}, 0
        elif ok:
            del self.seqs[seq_id]

    @precondition(lambda self: any(self.seqs.values()))
    @rule(data=st.data())
    def seq_clone(self, data):
        src = self.live_choice(data)
        upto = self.position_choice(data, src)
        ok = self.clone_ok(src, upto) and not self.single
        assert bool(self.cache.can_clone(src, upto)) == ok
        expected = self.lowest_id()
        dst = self.attempt(lambda: self.cache.seq_clone(src, upto), ok)
        if ok:
            assert dst == expected
            self.seqs[dst] = {p: v for p, v in self.seqs[src].items() if p < upto}
            self.written[dst] = self.written[src]


class SingleMachine(SequenceRules):
    shadow = ShadowSingle
    single = True


class BatchedSequenceMachine(SequenceRules):
    shadow = ShadowBatched


class CellMachine(SequenceRules):
    shadow = ShadowCells
    cells = True


TestSingle = SingleMachine.TestCase
TestSingle.settings = SETTINGS
TestBatchedSequence = BatchedSequenceMachine.TestCase
TestBatchedSequence.settings = SETTINGS
TestCells = CellMachine.TestCase
TestCells.settings = SETTINGS
