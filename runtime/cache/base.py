"""The step state machine every cache kind shares, and the id allocator of batched kinds.

State is one value: ``Idle`` (no plan) or ``Declared`` (a plan). ``declare_step``
validates everything and plans before it replaces the current plan, so a refusal leaves
the previous declaration standing. ``finish_step`` commits the plan, ``abort_step``
abandons it; every verb that changes what the cache holds returns the cache to Idle.
"""
from __future__ import annotations

import heapq
from typing import Generic, Optional, TypeVar

from .config import CacheConfig, CacheGeometry, LayerGeometry, check_cache_inputs
from .errors import CacheRefused, InvalidStep, StepStateError
from .plans import PolicyTable
from .step import ALLOWED, Step, Verdict, as_index, require_layer

PlanT = TypeVar("PlanT")


class CacheBase(Generic[PlanT]):
    """Bookkeeping shared by every kind: geometry, config, layouts and the step state."""

    kind: str = ""

    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        check_cache_inputs(geometry, config)
        self.geometry = geometry
        self.config = config
        self.policies = PolicyTable.build(geometry, config)
        self._plan: Optional[PlanT] = None
        # Bumped on every change of state, so a plan can tell whether it is still current.
        self.generation = 0
        # attend-call signatures already validated (see attend_checks): geometry never changes.
        self.checked_attends: dict[tuple, LayerGeometry] = {}

    # -- queries ------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def n_layers(self) -> int:
        return self.geometry.n_layers

    def layer_geometry(self, layer: int) -> LayerGeometry:
        """The geometry of cache layer ``layer``; AttendError for a layer the model lacks."""
        return self.geometry.layers[require_layer(layer, self.n_layers)]

    @property
    def is_declared(self) -> bool:
        return self._plan is not None

    def new_seq_allocates(self) -> bool:
        """Whether one more sequence (``seq_new`` or a fork) would make the cache allocate
        storage it does not hold yet. Kinds whose storage does not grow with the number of
        sequences answer False."""
        return False

    @property
    def step_plan(self) -> PlanT:
        """The declared step's plan; StepStateError when no step is declared."""
        if self._plan is None:
            raise StepStateError(
                "no step is declared: call declare_step(step) before the forward"
            )
        return self._plan

    def check_step(self, step: Step) -> Verdict:
        """Whether ``declare_step(step)`` would be accepted now, and why not."""
        try:
            self._plan_step(step)
        except CacheRefused as refused:
            return Verdict(refused.reason)
        return ALLOWED

    # -- the step protocol ----------------------------------------------------------
    def declare_step(self, step: Step) -> PlanT:
        """Validate and plan ``step``, then make it the current step.

        Raises CacheRefused (nothing changed, a previous declaration still stands).
        """
        if not isinstance(step, Step):
            raise InvalidStep(
                f"declare_step takes a Step(seq_ids, positions), got {type(step).__name__}"
            )
        plan = self._plan_step(step)
        self._plan = plan
        self.generation += 1
        return plan

    def finish_step(self) -> None:
        """The forward completed: commit lengths and high-water marks."""
        plan = self.step_plan
        self._commit(plan)
        self._drop_step()

    def abort_step(self) -> None:
        """The forward failed: leave every sequence as it was before the step."""
        plan = self.step_plan
        self._abandon(plan)
        self._drop_step()

    def _drop_step(self) -> None:
        self._plan = None
        self.generation += 1

    # -- what each kind provides ------------------------------------------------------
    def _plan_step(self, step: Step) -> PlanT:
        """Validate ``step`` against the current state and plan it; pure."""
        raise NotImplementedError

    def _commit(self, plan: PlanT) -> None:
        raise NotImplementedError

    def _abandon(self, plan: PlanT) -> None:
        raise NotImplementedError


def require_count(name: str, n: object) -> int:
    count = as_index(n)
    if count is None:
        raise InvalidStep(f"{name} must be a non-negative integer, got {n!r}")
    return count


class IdPool:
    """Sequence ids: ``take`` hands out the lowest id not in use."""

    def __init__(self, limit: Optional[int]) -> None:
        self.limit = limit
        self._live: set[int] = set()
        self._released: list[int] = []  # min-heap of ids below _next that are free
        self._next = 0

    def __contains__(self, seq_id: object) -> bool:
        # as_index first: True would otherwise match id 1, and a list would not hash.
        return as_index(seq_id) is not None and seq_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def live(self) -> tuple[int, ...]:
        return tuple(sorted(self._live))

    def check_room(self) -> Verdict:
        if self.limit is not None and len(self._live) >= self.limit:
            return Verdict(
                f"all {self.limit} sequence slots are in use; remove a sequence with seq_rm()"
            )
        return ALLOWED

    @property
    def high_water(self) -> int:
        """One past the highest id ever handed out (since the last ``clear``)."""
        return self._next

    def peek(self) -> int:
        """The id ``take`` would hand out next."""
        return self._released[0] if self._released else self._next

    def take(self) -> int:
        verdict = self.check_room()
        if not verdict:
            raise CacheRefused(verdict.reason or "")
        seq_id = heapq.heappop(self._released) if self._released else self._next
        if seq_id == self._next:
            self._next += 1
        self._live.add(seq_id)
        return seq_id

    def release(self, seq_id: int) -> None:
        self._live.remove(seq_id)
        heapq.heappush(self._released, seq_id)

    def clear(self) -> None:
        self._live.clear()
        self._released.clear()
        self._next = 0


def not_live(seq_id: object) -> CacheRefused:
    return CacheRefused(f"sequence {seq_id!r} is not live; create one with seq_new()")
