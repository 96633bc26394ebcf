"""A step plan put on the device: the forward, grammar masks, token draws, logprobs.

Everything here is queued lazily: the host goes on planning while the device computes.
The caller (the engine's loop) calls in here inside the session's launcher's
``building()``; graphs are handed over with its ``launch`` (``runtime.mlx.launcher``:
encoded inline or on a thread of its own), and the host reads what it launched only
through the launch's copies. Failures come back as data
(``(job, reason)`` pairs) for the loop to end those requests; nothing here ends a request
itself.

A failed forward leaves the cache as it was (the session aborts the step). With one
request in the step, that request failed; with several, each is run alone, evaluated at
once, so only those whose own forward fails end (failures are rare; this keeps each
one's error its own).

A constrained draw's mask depends on the sample's previous token, so a step with
constrained samples is launched in two halves: ``launch`` queues the forward (and the
plain draws of unconstrained parts), and ``draw`` — called once the loop has read the
previous step — computes the masks and queues the remaining draws.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from mlx_pte.runtime.mlx.bootstrap import mx
from mlx_pte.runtime.mlx.launcher import Launched

from ..sampling import device as device_sampling
from ..sampling.grammar import masks
from ..sampling.logprobs import logprob_arrays, read
from ..sampling.token_masks import apply_masks
from .jobs import Draw, Failures, Job
from .step_plan import StepPlan

if TYPE_CHECKING:
    from mlx_pte.interpreter.session import Session

    from ..sampling.logprobs import TokenLogprob


@dataclass
class Part:
    """One queued forward: the whole step, or one request's share of it. ``ids`` is None
    until its draws are queued too."""

    plan: StepPlan
    logits: mx.array
    draws: list[Draw]
    rows: list[int]  # each draw's row of ``logits``
    ids: Optional[mx.array] = None
    logprobs: Optional[tuple] = None
    launched: Optional[Launched] = None  # its last launch: ids and logprobs, else logits

    @property
    def constrained(self) -> bool:
        return any(d.sample.matcher is not None for d in self.draws)


@dataclass
class Launch:
    """A step's forwards on the device, and the requests whose forward failed."""

    parts: list[Part]
    failures: Failures
    alone: bool  # each request ran on its own (the whole step's forward failed)
    dispatched: float

    @property
    def needs_masks(self) -> bool:
        return any(part.ids is None and part.draws for part in self.parts)


@dataclass
class Flight:
    """A dispatched step whose token ids the host has not read yet."""

    plan: StepPlan  # what ran: the whole step, or the parts that worked
    ids: Optional[mx.array]  # one drawn token per entry of ``draws`` (fed to the next step); None when none
    launched: Launched  # its readable copies: the ids (or, drawing none, the logits) first
    draws: list[Draw]
    dispatched: float
    # (index of its first draw, the launch's copies of its logprob_arrays, each draw's top
    # count or None) per part
    logprobs: list[tuple[int, tuple, list[Optional[int]]]] = field(default_factory=list)
    read: bool = False


@dataclass
class Tokens:
    """What a flight drew, read back: each draw's token and logprob record, or the error."""

    ids: list[int] = field(default_factory=list)
    records: list[Optional["TokenLogprob"]] = field(default_factory=list)
    error: Optional[str] = None


class Runner:
    def __init__(self, session: "Session", vocab_size: int) -> None:
        self.session = session
        self.vocab_size = vocab_size

    def launch(self, plan: StepPlan, previous: Optional[Flight]) -> Launch:
        """Queue the step's forward, and its draws unless a sample is constrained."""
        dispatched = time.perf_counter()
        try:
            part = self._queue(plan, previous)
        except Exception as exc:
            if len(plan.jobs) == 1:
                return Launch([], _forward_failed(plan, exc), False, dispatched)
            return self._launch_alone(plan, previous, dispatched)
        part.launched = self._launch(part)
        return Launch([part], [], False, dispatched)

    def _launch_alone(self, plan: StepPlan, previous: Optional[Flight], dispatched: float) -> Launch:
        parts, failures = [], []
        for job in list(plan.jobs.values()):
            share = plan.only(job)
            try:
                part = self._queue(share, previous)
                part.launched = _settled(self._launch(part))
            except Exception as exc:
                failures += _forward_failed(share, exc)
                continue
            parts.append(part)
        return Launch(parts, failures, True, dispatched)

    def _launch(self, part: Part) -> Launched:
        """Hand the part's graph to MLX: its ids and logprobs, or (drawing nothing yet) its
        logits, which stand for the step's work."""
        arrays = [part.ids, *(part.logprobs or ())] if part.ids is not None else [part.logits]
        return self.session.launcher.launch(arrays, readable=arrays)

    def draw(self, launch: Launch) -> tuple[Optional[Flight], Failures]:
        """Queue the draws ``launch`` still owes (the constrained ones: the previous step
        must have been read, for the masks), and the flight of everything that ran."""
        failures: Failures = []
        plan, ids, draws, logprobs = StepPlan(), [], [], []
        for part in launch.parts:
            ran = True
            if part.ids is None and part.draws:
                try:
                    part.ids, part.logprobs = self._draw(part, failures)
                    part.launched = self._launch(part)
                    if launch.alone:
                        _settled(part.launched)
                except Exception as exc:
                    failures += _forward_failed(part.plan, exc)
                    if not launch.alone:
                        return None, failures
                    # Its requests fail; its draws keep their places so that later
                    # parts' samples find their tokens where the scheduler counted them.
                    part.ids, part.logprobs, ran = mx.zeros(len(part.draws), dtype=mx.uint32), None, False
            if ran:
                plan.absorb(part.plan)
            if part.ids is not None:
                ids.append(part.ids)
            logprobs += _logprob_parts(part, len(draws))
            draws += part.draws
        if not launch.parts:
            return None, failures
        if not launch.alone:
            (part,) = launch.parts
            return Flight(part.plan, part.ids, part.launched, part.draws, launch.dispatched, logprobs), failures
        joined = mx.concatenate(ids) if ids else launch.parts[-1].logits
        launched = self.session.launcher.launch([joined], readable=[joined])
        return Flight(plan, joined if ids else None, launched, draws, launch.dispatched, logprobs), failures

    def warm_up(self, sizes: Sequence[int]) -> None:
        """One forward for every pair of token count and sampled-row count in ``sizes``
        (rows never more than tokens), on a scratch sequence, so that each bucket's
        segments are traced now rather than inside a request's first steps. The cache is
        cleared after each (call it on an idle engine)."""
        cache = self.session.cache
        for tokens in sizes:
            for rows in [r for r in sizes if r <= tokens]:
                live = cache.live_seqs()
                seq = live[0] if live else cache.seq_new()
                try:
                    self.session.forward([0] * tokens, list(range(tokens)), seq, list(range(tokens - rows, tokens)))
                finally:
                    cache.clear()

    @staticmethod
    def collect(flight: Flight) -> Tokens:
        """Wait for a flight's token ids and read them (with their logprob records)."""
        flight.read = True
        try:
            readable = flight.launched.read()
            if flight.ids is None:
                mx.eval(readable)
            ids = readable.tolist() if flight.ids is not None else []
            return Tokens(ids, _logprob_records(flight, ids))
        except Exception as exc:
            return Tokens(error=f"the forward failed: {type(exc).__name__}: {exc}")

    # -- queuing ----------------------------------------------------------------------------
    def _queue(self, plan: StepPlan, previous: Optional[Flight]) -> Part:
        """The step's forward and, unless a sample is constrained, its draws (lazy)."""
        draws, draw_rows = plan.draws()
        tokens = mx.array(plan.prompt, dtype=mx.int64)
        if plan.feeds:
            assert previous is not None and previous.ids is not None  # fed only what it drew
            fed = device_sampling.take_rows(previous.ids, plan.feeds)
            tokens = mx.concatenate([fed.astype(mx.int64), tokens])
        rows = [r for r, _, _ in plan.rows] or [plan.size - 1]  # the program needs at least one row
        logits = self.session.forward(tokens, plan.positions, plan.seq_ids, rows, evaluate=False)
        part = Part(plan, logits, draws, draw_rows)
        if not draws or part.constrained:  # constrained draws wait for their masks
            return part
        try:
            part.ids, part.logprobs = self._draw(part, [])
        except Exception:  # the cache holds the step already: take it back before retrying
            self._rewind(plan)
            raise
        return part

    def _draw(self, part: Part, failures: Failures) -> tuple[mx.array, Optional[tuple]]:
        """Token ids drawn from the part's rows, masked by each sample's grammar, and,
        when some draw wants them, the log-probabilities of those same rows (lazy). A
        sample whose grammar fails lands in ``failures`` (its row is left unmasked)."""
        samples = [d.sample for d in part.draws]
        rows = device_sampling.take_rows(part.logits, part.rows)
        if part.constrained:
            def failed(row: int, exc: Exception) -> None:
                failures.append((part.draws[row].job, f"the request's grammar failed: {exc}"))

            matchers = [s.matcher if s.finish_reason is None else None for s in samples]
            rows = apply_masks(rows, masks(matchers, self.vocab_size, on_error=failed))
        ids = device_sampling.draw(rows, [s.stream for s in samples])
        wants = [s.logprob_top for s in samples if s.logprob_top is not None]
        return ids, (logprob_arrays(rows, ids, max(wants)) if wants else None)

    def _rewind(self, plan: StepPlan) -> None:
        """Undo a step the cache has committed: each sequence back to where the step began."""
        start: dict[int, int] = {}
        for seq, pos in zip(plan.seq_ids, plan.positions):
            start[seq] = min(pos, start.get(seq, pos))
        for seq, pos in start.items():
            self.session.cache.rewind(seq, pos)


def _settled(launched: Launched) -> Launched:
    """``launched``, evaluated: a failure to encode or run it raises here."""
    mx.eval(launched.read())
    return launched


def _forward_failed(plan: StepPlan, exc: Exception) -> Failures:
    return [(job, f"the forward failed: {type(exc).__name__}: {exc}") for job in plan.jobs.values()]


def _logprob_parts(part: Part, first_draw: int) -> list:
    if part.logprobs is None:
        return []
    # The launch's copies: ids first, then the logprob arrays.
    return [(first_draw, tuple(part.launched.copies[1:]), [d.sample.logprob_top for d in part.draws])]


def _logprob_records(flight: Flight, ids: list[int]) -> list[Optional["TokenLogprob"]]:
    """Each draw's log-probability record (None where the request asked for none)."""
    records: list[Optional["TokenLogprob"]] = [None] * len(ids)
    for first, arrays, wants in flight.logprobs:
        chunk = read(ids[first : first + len(wants)], arrays, [w or 0 for w in wants])
        for i, (want, record) in enumerate(zip(wants, chunk)):
            if want is not None:
                records[first + i] = record
    return records
