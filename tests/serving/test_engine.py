"""The batching engine against single-sequence generation (the oracle), on both batched kinds.

The oracle is ``generate()`` on a ``single`` session: one request at a time, nothing
shared. Batched greedy outputs must equal it token for token, whatever else shares the
step; seeded samples must equal independent runs seeded ``seed + i``.
"""
from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings, strategies as st

from mlx_pte.serving.engine import (
    Engine,
    Request,
    RequestFailed,
    RequestRejected,
    Status,
)
from mlx_pte.serving.sampling.params import SamplingParams
from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.manifest import Manifest

KINDS = ("batched-sequence", "batched-cell")
# Mixed lengths: one token, short, longer than max_step (chunked), medium.
PROMPTS = (
    [17],
    [40, 41, 42, 43, 44],
    list(range(100, 140)),
    [7, 300, 9, 301, 11, 302, 13, 303, 15, 304, 17, 305, 19],
)


def run_checked(engine: Engine, handles, events: dict) -> int:
    """Run to the end, checking the cache's logical state after every iteration.

    ``events[request_id][sample]`` holds the tokens streamed so far (see ``submit_all``).
    Returns the most requests that waited at once.
    """
    prompt_len = {h.id: h.stats.prompt_tokens for h in handles}
    most_waiting = 0
    while engine.has_work:
        engine.step()
        most_waiting = max(most_waiting, len(engine.waiting()))
        live = engine.sequences()
        usage = engine.cache.usage()
        assert usage.logical_positions == sum(s.length for s in live)
        assert sorted(s.seq_id for s in live) == sorted(engine.cache.live_seqs())
        for s in live:
            emitted = events.get(s.request_id, {}).get(s.index, [])
            if emitted:  # decoding: the prompt plus every drawn token but the last
                assert s.length == prompt_len[s.request_id] + len(emitted) + s.unread - 1
    return most_waiting


def submit_all(engine: Engine, requests, events: dict):
    """Submit, streaming each request's tokens into ``events[request_id][sample]``."""

    def collect(event):
        if event.token is not None:
            events.setdefault(event.request_id, {}).setdefault(event.index, []).append(event.token)

    return [engine.submit(r, on_event=collect) for r in requests]


# gemma3 mixes a sliding-window layer (window 4, a ring the prompts wrap) with a flat one;
# qwen3_moe routes each row of a batch to its own experts; gpt_oss adds attention sinks on both.
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_equals_single_sequence(programs, oracle, kind, family):
    engine = Engine(programs(family), kind, capacity=400, max_batch_tokens=24)
    events: dict = {}
    handles = submit_all(engine, [Request(p, max_tokens=10, ignore_eos=True) for p in PROMPTS[:2]], events)
    for _ in range(3):  # the first two are decoding when the others arrive
        engine.step()
    handles += submit_all(engine, [Request(p, max_tokens=10, ignore_eos=True) for p in PROMPTS[2:]], events)
    run_checked(engine, handles, events)
    for prompt, handle in zip(PROMPTS, handles):
        expected = oracle(prompt, 10, family=family)
        (sample,) = handle.result(timeout=0).samples
        assert sample.tokens == expected.tokens
        assert sample.finish_reason == "length"
        assert events[handle.id][0] == expected.tokens
    assert engine.cache.live_seqs() == ()
    assert engine.stats.decode_steps > 0 and engine.stats.decode_tps > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", KINDS)
def test_forked_greedy_samples_equal_independent_runs(programs, oracle, kind, family):
    prompt = PROMPTS[2]
    engine = Engine(programs(family), kind, capacity=400)
    events: dict = {}
    handles = submit_all(engine, [Request(prompt, max_tokens=8, n=3, ignore_eos=True)], events)
    run_checked(engine, handles, events)
    (handle,) = handles
    samples = handle.result(timeout=0).samples
    expected = oracle(prompt, 8, family=family).tokens
    assert [s.tokens for s in samples] == [expected] * 3
    assert engine.stats.prompt_tokens == len(prompt)  # prefilled once, then forked


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_samples_reproduce_independent_runs(program, oracle, kind):
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=1.0, top_k=50, seed=11)
    engine = Engine(program, kind, capacity=400)
    first = engine.submit(Request(prompt, max_tokens=8, sampling=params, n=3, ignore_eos=True))
    again = engine.submit(Request(prompt, max_tokens=8, sampling=params, n=3, ignore_eos=True))
    engine.run()
    got = [s.tokens for s in first.result(timeout=0).samples]
    assert got == [s.tokens for s in again.result(timeout=0).samples]
    for i, tokens in enumerate(got):
        independent = SamplingParams(temperature=1.0, top_k=50, seed=11 + i)
        assert tokens == oracle(prompt, 8, independent).tokens
    assert len({tuple(t) for t in got}) > 1, "different seeds gave identical samples"


@pytest.mark.parametrize("kind", KINDS)
def test_small_pool_queues_requests_and_completes_all(program, oracle, kind):
    # Each request may grow to 20 + 12 - 1 = 31 positions: the pool takes two at a time.
    prompts = [list(range(200 + 20 * i, 220 + 20 * i)) for i in range(5)]
    engine = Engine(program, kind, capacity=70, max_batch_tokens=32)
    events: dict = {}
    handles = submit_all(engine, [Request(p, max_tokens=12, ignore_eos=True) for p in prompts], events)
    engine.step()
    engine.step()  # the first step's budget went to two prefills; now the third is tried
    queued = [h for h in handles if h.status == Status.QUEUED]
    assert len(queued) == 3
    assert "70" in queued[0].waiting_reason and "reserved 62" in queued[0].waiting_reason
    assert run_checked(engine, handles, events) >= 1
    for prompt, handle in zip(prompts, handles):
        assert handle.result(timeout=0).samples[0].tokens == oracle(prompt, 12).tokens
        assert handle.stats.queue_seconds >= 0
    assert handles[-1].stats.queue_seconds > handles[0].stats.queue_seconds


@pytest.mark.parametrize("kind", KINDS)
def test_request_that_can_never_fit_fails_at_once_with_the_reason(program, oracle, kind):
    engine = Engine(program, kind, capacity=30, max_seqs=2)
    with pytest.raises(RequestRejected, match="30"):
        engine.submit(Request(list(range(50, 80)), max_tokens=4))  # 30 + 1 > 30
    with pytest.raises(RequestRejected, match="lower n"):
        engine.submit(Request([5, 6], max_tokens=4, n=3))  # 3 sequences, 2 allowed
    ok = engine.submit(Request(PROMPTS[1], max_tokens=4, ignore_eos=True))
    engine.run()
    assert ok.result(timeout=0).samples[0].tokens == oracle(PROMPTS[1], 4).tokens


def test_a_single_cache_serves_one_request_at_a_time(program, oracle):
    """``single`` is a batched cache of one sequence: the engine runs over it unchanged,
    admitting the next request when the running one ends."""
    engine = Engine(program, "single", capacity=200, prompt_cache_tokens=200)
    with pytest.raises(RequestRejected, match="lower n"):
        engine.submit(Request([5, 6], max_tokens=4, n=2))
    handles = [engine.submit(Request(p, max_tokens=6, ignore_eos=True)) for p in PROMPTS]
    engine.step()
    assert [h.status for h in handles[1:]] == [Status.QUEUED] * 3
    assert "sequences are taken" in handles[1].waiting_reason
    engine.run()
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.result(timeout=0).samples[0].tokens == oracle(prompt, 6).tokens


def test_max_tokens_past_the_cache_ends_with_capacity(program, oracle):
    engine = Engine(program, "batched-sequence", capacity=12)
    handle = engine.submit(Request(PROMPTS[1], max_tokens=50, ignore_eos=True))
    engine.run()
    (sample,) = handle.result(timeout=0).samples
    # 5 prompt positions + 7 fed tokens fill 12 positions; the 8th token is sampled last.
    assert sample.finish_reason == "capacity"
    assert sample.tokens == oracle(PROMPTS[1], 8).tokens


def test_stop_strings_and_ids_trim_the_output(program, oracle):
    prompt = "def main():"
    expected = oracle(prompt, 12)
    codec = TextCodec(Manifest.from_dict(program.manifest))
    text = expected.text
    cut = len(codec.decode(expected.tokens[:4]))
    stop = text[cut + 1 : cut + 3]
    assert len(stop) == 2 and text.find(stop) >= 0
    kept = text[: text.find(stop)]

    engine = Engine(program, "batched-cell", capacity=200)
    by_string = engine.submit(Request(prompt, max_tokens=12, stop=(stop,), ignore_eos=True))
    by_id = engine.submit(Request(prompt, max_tokens=12, stop_ids=(expected.tokens[5],), ignore_eos=True))
    engine.run()
    streamed = "".join(e.text for e in by_string.events(timeout=0))
    (sample,) = by_string.result(timeout=0).samples
    assert sample.finish_reason == "stop"
    assert sample.text == streamed == kept
    # The tokens kept are the most whose text lies inside the kept text.
    k = len(sample.tokens)
    assert sample.tokens == expected.tokens[:k]
    assert kept.startswith(codec.decode(expected.tokens[:k]))
    assert not kept.startswith(codec.decode(expected.tokens[: k + 1]))
    first = expected.tokens.index(expected.tokens[5])
    assert by_id.result(timeout=0).samples[0].tokens == expected.tokens[: first + 1]
    assert engine.cache.live_seqs() == ()


def test_streams_callbacks_and_stats(program, oracle):
    engine = Engine(program, "batched-sequence", capacity=200)
    seen = []
    handle = engine.submit(Request("def main():", max_tokens=6, ignore_eos=True), on_event=seen.append)
    engine.run()
    events = list(handle.events(timeout=0))
    assert events == seen
    expected = oracle("def main():", 6)
    assert [e.token for e in events if e.token is not None] == expected.tokens
    assert "".join(e.text for e in events) == expected.text
    assert events[-1].finish_reason == "length"
    stats = handle.stats
    assert stats.prompt_tokens == expected.prompt_tokens
    assert stats.generated_tokens == 6 and stats.decoded_tokens == 5
    assert stats.prefill_tps > 0 and stats.decode_tps > 0


def test_threaded_submits_and_cancel(program, oracle):
    engine = Engine(program, "batched-cell", capacity=400, max_batch_tokens=16)
    engine.start()
    try:
        handles: dict[int, object] = {}

        def client(i):
            handles[i] = engine.submit(Request(PROMPTS[i], max_tokens=8, ignore_eos=True))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        doomed = engine.submit(Request(PROMPTS[2], max_tokens=200, ignore_eos=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        next(iter(doomed.events(timeout=60)))  # it is decoding
        doomed.cancel()
        for i, prompt in enumerate(PROMPTS):
            assert handles[i].result(timeout=60).samples[0].tokens == oracle(prompt, 8).tokens
        with pytest.raises(RequestFailed, match="cancelled"):
            doomed.result(timeout=60)
        assert doomed.status == Status.CANCELLED
    finally:
        engine.stop(timeout=30)
    assert engine.cache.live_seqs() == ()


@settings(max_examples=12, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("kind", KINDS)
def test_mixed_arrivals_and_early_stops_equal_single_sequence(programs, oracle, kind, data):
    # Pipelined iterations learn of a stop token one step late; whatever arrives, stops
    # or forks alongside, each greedy sample must still equal its single-sequence run.
    engine = Engine(programs("llama"), kind, capacity=500, max_batch_tokens=24)
    count = data.draw(st.integers(1, 4), label="requests")
    plans = []
    for _ in range(count):
        prompt = data.draw(st.sampled_from(PROMPTS), label="prompt")
        max_tokens = data.draw(st.integers(1, 9), label="max_tokens")
        expected = oracle(prompt, max_tokens).tokens
        stop_at = data.draw(st.one_of(st.none(), st.integers(0, max_tokens - 1)), label="stop at")
        stop_ids = (expected[stop_at],) if stop_at is not None else ()
        if stop_ids:
            expected = expected[: expected.index(stop_ids[0]) + 1]
        n = data.draw(st.integers(1, 2), label="n")
        arrives = data.draw(st.integers(0, 6), label="arrival step")
        plans.append((arrives, Request(prompt, max_tokens=max_tokens, stop_ids=stop_ids, n=n, ignore_eos=True), expected))
    events: dict = {}
    handles: list = []
    pending = sorted(plans, key=lambda plan: plan[0])
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            _, request, expected = pending.pop(0)
            (handle,) = submit_all(engine, [request], events)
            handles.append((handle, expected))
        engine.step()
        step += 1
        live = engine.sequences()
        assert engine.cache.usage().logical_positions == sum(s.length for s in live)
    for handle, expected in handles:
        for sample in handle.result(timeout=0).samples:
            assert sample.tokens == expected
            assert events[handle.id][sample.index] == expected
    assert engine.cache.live_seqs() == () and engine.cache.usage().logical_positions == 0
