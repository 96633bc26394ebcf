"""The scheduler alone, over the neutral (byte-less) cache: no model, no MLX.

A hypothesis state machine drives it as the engine's loop does — arrivals (prompts that
share prefixes, several samples), steps, early stops, cancels, and a cache that refuses
every step while "blocked" — and checks it against brute force:

- admission: a request starts iff it is the head of the queue, the step has room, its
  samples fit the decode slots and the sequence limit, and the worst-case positions of
  the running requests plus its own, counted one by one, fit the capacity; a request the
  cache refuses waits (or, refused with nothing running, fails with the cache's reason);
- content: a shadow of every sequence, written token by token from the plans, forked,
  rewound and removed as the scheduler asks; each planned token must extend its
  sequence, and a "model" whose next token is a hash of the whole history must give
  every finished request the tokens a cold run of the same model gives, so a prefix
  forked from a retained sequence is exactly the prompt's.
"""
from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from mlx_pte.runtime.cache import CACHE_FACTORY, NEUTRAL_BACKEND, CacheConfig, CacheGeometry, LayerPolicy, Verdict
from mlx_pte.serving.engine.jobs import Job, Sample
from mlx_pte.serving.engine.prompt_store import PromptStore
from mlx_pte.serving.engine.requests import Request, RequestHandle, RequestRejected
from mlx_pte.serving.engine.scheduler import MIN_SHARE, Limits, Scheduler

from tests.serving.test_engine_reuse_admission import BASES, TAILS, sample_cap, worst_case_units

KINDS = ("batched-sequence", "batched-cell")
MAX_CONTEXT = 64
REFUSAL = "the cache is blocked (injected)"


def next_token(history: list[int]) -> int:
    """The stand-in model: the next token is a function of the whole history."""
    return 1000 + hash(tuple(history)) % 97


def cold(prompt: list[int], count: int) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(count):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


class ShadowCache:
    """The neutral cache, with a shadow of each sequence's tokens and a refusal switch."""

    def __init__(self, cache) -> None:
        self._cache = cache
        self.shadow: dict[int, list[int]] = {}
        self.blocked = False
        self.store: PromptStore = PromptStore(0, cache.seq_rm)  # the scheduler's, once made

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def check_step(self, step) -> Verdict:
        return Verdict(REFUSAL) if self.blocked else self._cache.check_step(step)

    def seq_new(self) -> int:
        self.check_growth()
        seq = self._cache.seq_new()
        self.shadow[seq] = []
        return seq

    def seq_clone(self, src: int, upto: int) -> int:
        self.check_growth(src)
        seq = self._cache.seq_clone(src, upto)
        self.shadow[seq] = self.shadow[src][:upto]
        return seq

    def seq_rm(self, seq: int) -> None:
        self._cache.seq_rm(seq)
        del self.shadow[seq]

    def rewind(self, seq: int, position: int) -> None:
        self._cache.rewind(seq, position)
        del self.shadow[seq][position:]

    def check_growth(self, source: Optional[int] = None) -> None:
        """Retained prompts never make the cache allocate: a new sequence that would finds
        none retained, but the one it forks from."""
        if self._cache.new_seq_allocates():
            assert {e.seq_id for e in self.store} <= {source}, "a retained prompt made the cache grow"


def machine(kind: str):
    class SchedulerMachine(RuleBasedStateMachine):
        @initialize(capacity=st.integers(30, 120), budget=st.integers(4, 24), max_seqs=st.sampled_from([None, 3, 5]),
                    store=st.sampled_from([0, 25, 10_000]), window=st.sampled_from([0, 6]))
        def start(self, capacity, budget, max_seqs, store, window):
            policies = (LayerPolicy.flat(), LayerPolicy.from_window(window))
            geometry = CacheGeometry.uniform(policies, 2, 8)
            config = CacheConfig(capacity, max_write=budget, max_seqs=max_seqs)
            self.cache = ShadowCache(CACHE_FACTORY.build(NEUTRAL_BACKEND, kind, geometry, config))
            limits = Limits(budget, capacity, MAX_CONTEXT, self.cache.max_seqs())
            self.store = self.cache.store = PromptStore(store, self.cache.seq_rm)
            self.sched = Scheduler(self.cache, limits, self.store)
            self.next_id = 0
            self.jobs: list[Job] = []  # submitted, not ended
            self.done: list[tuple[list[int], list[int]]] = []  # (prompt, tokens) to continue
            # (request id, sample index) to stop at its next token; not id(sample), which a
            # later sample may reuse once this one is freed, making replays differ
            self.stop_next: set[tuple[int, int]] = set()
            self.last_ids: list[int] = []  # the previous step's draws

        # -- arrivals -------------------------------------------------------------------
        def submit(self, prompt: list[int], max_tokens: int, n: int) -> None:
            try:
                cap, units = self.sched.sizes(len(prompt), n, max_tokens)
            except RequestRejected:
                s = self.sched.limits
                assert n > s.token_budget or (s.max_seqs is not None and n > s.max_seqs) or \
                    len(prompt) + 1 > sample_cap(kind, s.capacity, MAX_CONTEXT, len(prompt), n)
                return
            assert cap == sample_cap(kind, self.sched.limits.capacity, MAX_CONTEXT, len(prompt), n)
            assert units == worst_case_units(kind, self.sched.limits.capacity, MAX_CONTEXT, len(prompt), n, max_tokens)
            handle = RequestHandle(self.next_id, Request(prompt, max_tokens=max_tokens, n=n), len(prompt), None)
            self.next_id += 1
            job = Job(handle, list(prompt), cap, units, [Sample(i) for i in range(n)])
            self.sched.enqueue([job])
            self.jobs.append(job)

        @rule(base=st.sampled_from(BASES), cut=st.integers(1, 16), tail=TAILS,
              max_tokens=st.integers(1, 8), n=st.integers(1, 3))
        def new_branch(self, base, cut, tail, max_tokens, n):
            self.submit(base[:cut] + tail, max_tokens, n)

        @precondition(lambda self: self.done)
        @rule(data=st.data(), keep=st.integers(0, 8), tail=TAILS, max_tokens=st.integers(1, 8))
        def continue_conversation(self, data, keep, tail, max_tokens):
            # keep < len(tokens): the reply as the client resends it differs from the one
            # retained (retokenized, or cut), so the match ends inside the reply.
            prompt, tokens = data.draw(st.sampled_from(self.done))
            self.submit(prompt + tokens[:keep] + tail, max_tokens, 1)

        # -- the world around the scheduler -------------------------------------------------
        @rule(blocked=st.booleans())
        def cache_blocks(self, blocked):
            self.cache.blocked = blocked

        @precondition(lambda self: self.jobs)
        @rule(data=st.data())
        def cancel(self, data):
            data.draw(st.sampled_from(self.jobs)).handle.cancel()

        @precondition(lambda self: any(j.live for j in self.sched.active))
        @rule(data=st.data())
        def stop_early(self, data):
            job, sample = data.draw(st.sampled_from([(j, s) for j in self.sched.active for s in j.live]))
            self.stop_next.add((job.handle.id, sample.index))

        @rule(steps=st.integers(1, 3))
        def step(self, steps):
            for _ in range(steps):
                self.one_step()

        # -- one iteration, as the loop runs it -------------------------------------------
        def one_step(self) -> None:
            sched = self.sched
            for job in sched.take_cancelled():
                self.jobs.remove(job)
            for job in [j for j in sched.active if j.handle._cancelled.is_set()]:
                for sample in job.samples:
                    if sample.finish_reason is None:
                        self.finish(job, sample, "cancelled")
            size, running = self.planned_before_admissions()
            waiting = list(sched.waiting)
            plan = sched.plan()
            admitted = [j for j in waiting if j in sched.active]
            refused = [j for j, _ in plan.refused]
            if size is None:  # a job waiting on a shared prefix: its chunk is the plan's
                admitted_ids = {j.handle.id for j in admitted}
                size = plan.step.size - sum(c for j, c in plan.step.chunks if j.handle.id in admitted_ids)
                running = [(j.prompt_len, len(j.samples), j.max_tokens) for j in sched.active if j not in admitted]
            expected = self.expected_admissions(waiting, size, running)
            assert (admitted, refused) == expected, (admitted, refused, expected)
            for job in admitted:
                assert job.fed <= job.prompt_len - 1
            for job, reason in plan.refused:
                assert REFUSAL in reason or "cannot start" in reason
                sched.drop(job)
                self.jobs.remove(job)
            step = plan.step
            assert step.size <= sched.limits.token_budget
            if not step.size:
                return
            self.run_forward(step)
            draws, rows = step.draws()
            assert sched.advance(step, draws) == []  # every fork succeeds on this cache
            ids = []
            for draw, k in zip(draws, rows):
                r = step.rows[k][0]
                history = self.cache.shadow[step.seq_ids[r]][: step.positions[r] + 1]
                ids.append(next_token(history))
            self.last_ids = ids
            for draw, token in zip(draws, ids):
                self.read(draw.job, draw.sample, token)

        def run_forward(self, step) -> None:
            """Write the step into the cache and its shadow, checking every token extends
            its sequence."""
            self.cache.declare_step(step.step())
            tokens = [self.last_ids[i] for i in step.feeds] + step.prompt
            for seq, pos, token in zip(step.seq_ids, step.positions, tokens):
                assert pos == len(self.cache.shadow[seq]), "a planned token must extend its sequence"
                self.cache.shadow[seq].append(token)
            self.cache.finish_step()

        def read(self, job: Job, sample: Sample, token: int) -> None:
            if sample.finish_reason is not None:
                return
            sample.tokens.append(token)
            if (job.handle.id, sample.index) in self.stop_next:
                self.finish(job, sample, "stop")
            elif sample.pending is None:
                self.finish(job, sample, "length" if len(sample.tokens) >= job.max_tokens else "capacity")

        def finish(self, job: Job, sample: Sample, reason: str) -> None:
            sample.finish_reason = reason
            self.sched.retire(job, sample, retain=reason != "cancelled")
            if not job.ended:
                return
            self.sched.release(job, retain=True)
            self.jobs.remove(job)
            if any(s.finish_reason == "cancelled" for s in job.samples):
                return
            room = job.cap - job.prompt_len + 1
            full = cold(job.ids, min(job.max_tokens, room))
            for s in job.samples:
                assert s.tokens == full[: len(s.tokens)], "a sample's tokens differ from a cold run"
                if s.finish_reason != "stop":
                    assert s.tokens == full
                    assert s.finish_reason == ("length" if len(full) == job.max_tokens else "capacity")
            if all(s.finish_reason != "stop" for s in job.samples):
                self.done.append((job.ids, full))

        def planned_before_admissions(self) -> tuple[int, list[tuple[int, int, int]]]:
            """Tokens the next step holds before it admits anyone (decodes, continuing
            prefills), and the running requests' (prompt length, n, max tokens)."""
            sched, budget = self.sched, self.sched.limits.token_budget
            size = sum(1 for j in sched.active for s in j.live if s.pending is not None)
            for job in sched.active:
                if job.fed < job.prompt_len and size < budget:
                    if job.share is not None:
                        return None, []  # whether it forks now, and where, is checked by content
                    size += min(job.prompt_len - job.fed, budget - size)
            return size, [(j.prompt_len, len(j.samples), j.max_tokens) for j in sched.active]

        def expected_admissions(self, waiting: list[Job], size: int, running: list) -> tuple[list[Job], list[Job]]:
            """Brute force: which of ``waiting`` the plan admits and which it refuses for
            good. An admitted prompt's first chunk is what its fork (``job.fed``, checked
            by content elsewhere) leaves to compute, up to the budget."""
            lim = self.sched.limits
            admitted, refused = [], []
            running_jobs = list(self.sched.active)
            for job in waiting:
                if size >= lim.token_budget:
                    break
                n = len(job.samples)
                slots = sum(r[1] for r in running) + n
                units = sum(worst_case_units(kind, lim.capacity, MAX_CONTEXT, *r) for r in running)
                units += worst_case_units(kind, lim.capacity, MAX_CONTEXT, job.prompt_len, n, job.max_tokens)
                # One admitted to share a running prompt's prefix waits for it without a
                # sequence, so the cache is asked nothing yet.
                shares = job.share is not None
                if shares:
                    source, length = job.share
                    assert length >= MIN_SHARE and source in running_jobs
                    assert job.ids[:length] == source.ids[:length] and length < job.prompt_len
                fits = (slots <= lim.token_budget and (lim.max_seqs is None or slots <= lim.max_seqs)
                        and units <= lim.capacity and (shares or not self.cache.blocked))
                if not fits:
                    if running:
                        break
                    refused.append(job)
                    continue
                admitted.append(job)
                running = running + [(job.prompt_len, n, job.max_tokens)]
                running_jobs = running_jobs + [job]
                if not shares:
                    size += min(job.prompt_len - job.fed, lim.token_budget - size)
            return admitted, refused

        # -- invariants -------------------------------------------------------------------
        @invariant()
        def reservations_and_sequences_add_up(self):
            sched = getattr(self, "sched", None)
            if sched is None:
                return
            lim = sched.limits
            units = sum(worst_case_units(kind, lim.capacity, MAX_CONTEXT, j.prompt_len, len(j.samples), j.max_tokens)
                        for j in sched.active)
            assert sched.reserved == units
            assert sched.slots == sum(len(j.samples) for j in sched.active)
            assert units + self.store.tokens <= lim.capacity
            if lim.max_seqs is not None:
                assert sched.slots + len(self.store) <= lim.max_seqs
            held = {e.seq_id for e in self.store}
            for job in sched.active:
                held |= {seq for seq, _ in job.finished}
                for s in job.samples:
                    if s.seq_id is not None:
                        held.add(s.seq_id)
                        assert self.cache.shadow[s.seq_id] == (job.ids + s.tokens)[: s.length]
            assert set(self.cache.live_seqs()) == held == set(self.cache.shadow)
            for entry in self.store:
                assert self.cache.shadow[entry.seq_id] == entry.tokens.tolist()
            for seq, tokens in self.cache.shadow.items():
                assert self.cache.pos(seq) == len(tokens)

        def teardown(self):
            if getattr(self, "sched", None) is None:
                return
            self.cache.blocked = False
            for _ in range(2000):
                if not (self.sched.has_work or self.jobs):
                    break
                self.one_step()
            assert not self.jobs and not self.sched.has_work

    return SchedulerMachine


@pytest.mark.parametrize("kind", KINDS)
def test_the_scheduler_against_brute_force(kind):
    run_state_machine_as_test(machine(kind), settings=settings(max_examples=60, stateful_step_count=40, deadline=None))
