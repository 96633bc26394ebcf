"""Prompt reuse never changes admission: a state machine against a brute-force model.

Requests whose prompts share prefixes (continued conversations, divergent branches)
arrive at random over a small cache with a prompt store. Every admission decision the
engine makes is compared with a model of the engine *without* a store: a request starts
iff its samples fit in the step's decode slots (and the sequence limit) and the
worst-case positions of the running requests plus its own, counted one by one, fit in
the capacity. Retained prompts must give way every time; every greedy output must still
equal a cold single-sequence run.
"""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from mlx_pte.serving.engine import Engine, Request, RequestRejected

from tests.serving.test_engine_reuse import check_store

BASES = (list(range(300, 316)), list(range(400, 412)) + [300, 301], [300, 301, 302] + list(range(500, 510)))
TAILS = st.lists(st.integers(600, 620), min_size=0, max_size=5)


def sample_cap(kind: str, capacity: int, max_context: int, prompt_len: int, n: int) -> int:
    """The most positions each of ``n`` samples may hold: an equal share of the cache."""
    if kind == "batched-cell":
        return min(max_context, prompt_len + (capacity - prompt_len) // n)
    return min(max_context, capacity // n)


def worst_case_units(kind: str, capacity: int, max_context: int, prompt_len: int, n: int, max_tokens: int) -> int:
    """Capacity units ``n`` greedy samples of a prompt may hold, counted position by
    position: a sequence layout stores each sample's whole history, a cell pool stores
    the shared prompt once."""
    final = min(prompt_len + max_tokens - 1, sample_cap(kind, capacity, max_context, prompt_len, n))
    if kind == "batched-cell":
        held = {("prompt", p) for p in range(prompt_len)}
        held |= {(i, p) for i in range(n) for p in range(prompt_len, final)}
    else:
        held = {(i, p) for i in range(n) for p in range(final)}
    return len(held)


def admission_machine(program, oracle, kind: str):
    class ReuseAdmission(RuleBasedStateMachine):
        @initialize(capacity=st.integers(40, 120), budget=st.sampled_from([0, 25, 60, 10_000]),
                    max_seqs=st.sampled_from([None, 3, 5]))
        def start(self, capacity, budget, max_seqs):
            self.engine = Engine(program, kind, capacity=capacity, max_batch_tokens=32, max_seqs=max_seqs,
                                 prompt_cache_tokens=budget)
            self.handles: list = []
            self.done: list = []  # (prompt, tokens) of finished requests, to continue
            self.decisions = 0
            real_admit = self.engine.scheduler._admit
            machine = self

            def admit(job, build):
                expected = machine.cold_would_admit(job)
                admitted = real_admit(job, build)
                assert admitted == expected, (
                    f"admitted={admitted}, a cold engine would {'' if expected else 'not '}admit; "
                    f"waiting: {job.handle.waiting_reason}"
                )
                machine.decisions += 1
                return admitted

            self.engine.scheduler._admit = admit

        def cold_would_admit(self, job) -> bool:
            engine = self.engine
            running = [(j.prompt_len, len(j.samples), j.handle.request.max_tokens) for j in engine.scheduler.active]
            slots = sum(n for _, n, _ in running) + len(job.samples)
            units = sum(worst_case_units(kind, engine.capacity, engine.max_context, *r) for r in running)
            units += worst_case_units(kind, engine.capacity, engine.max_context, job.prompt_len,
                                      len(job.samples), job.handle.request.max_tokens)
            return (slots <= engine.token_budget and (engine.max_seqs is None or slots <= engine.max_seqs)
                    and units <= engine.capacity)

        def submit(self, prompt, max_tokens, n):
            try:
                handle = self.engine.submit(Request(prompt, max_tokens=max_tokens, n=n, ignore_eos=True))
            except RequestRejected:
                return
            self.handles.append((prompt, handle))

        @rule(base=st.sampled_from(BASES), cut=st.integers(1, 16), tail=TAILS,
              max_tokens=st.integers(1, 8), n=st.integers(1, 2))
        def new_branch(self, base, cut, tail, max_tokens, n):
            self.submit(base[:cut] + tail, max_tokens, n)

        @precondition(lambda self: self.done)
        @rule(data=st.data(), tail=TAILS, max_tokens=st.integers(1, 8))
        def continue_conversation(self, data, tail, max_tokens):
            prompt, tokens = data.draw(st.sampled_from(self.done))
            self.submit(prompt + tokens + tail, max_tokens, 1)

        @rule(steps=st.integers(1, 4))
        def step(self, steps):
            for _ in range(steps):
                self.engine.step()
            self.collect()

        def collect(self):
            for prompt, handle in [h for h in self.handles if h[1].done]:
                self.handles.remove((prompt, handle))
                result = handle.result(timeout=0)  # raises if it failed
                n, engine = handle.request.n, self.engine
                # A sample whose share of the cache is full ends early ("capacity").
                room = sample_cap(kind, engine.capacity, engine.max_context, len(prompt), n) - len(prompt) + 1
                expected = oracle(prompt, handle.request.max_tokens).tokens[:room]
                assert [s.tokens for s in result.samples] == [expected] * n
                self.done.append((prompt, expected))

        @invariant()
        def store_fits_beside_the_reservations(self):
            engine = getattr(self, "engine", None)
            if engine is None:
                return
            check_store(engine)
            reserved = sum(worst_case_units(kind, engine.capacity, engine.max_context, j.prompt_len,
                                            len(j.samples), j.handle.request.max_tokens) for j in engine.scheduler.active)
            assert reserved + engine.prompt_store.tokens <= engine.capacity
            running = sum(len(j.samples) for j in engine.scheduler.active)
            if engine.max_seqs is not None:
                assert running + len(engine.prompt_store) <= engine.max_seqs
            in_use = len(engine.prompt_store) + sum(
                1 for j in engine.scheduler.active for s in j.samples if s.seq_id is not None) + sum(
                len(j.finished) for j in engine.scheduler.active)
            assert len(engine.cache.live_seqs()) == in_use

        def teardown(self):
            engine = getattr(self, "engine", None)
            if engine is None:
                return
            engine.run()
            self.collect()
            assert not self.handles

    return ReuseAdmission


@pytest.mark.parametrize("kind", ("batched-sequence", "batched-cell"))
def test_reuse_never_changes_an_admission_decision(program, oracle, kind):
    run_state_machine_as_test(
        admission_machine(program, oracle, kind),
        settings=settings(max_examples=25, stateful_step_count=25, deadline=None),
    )
