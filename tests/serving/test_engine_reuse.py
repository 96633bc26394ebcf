"""Prompt reuse across requests: greedy outputs with a prompt store equal cold runs.

The oracle is ``generate()`` on a fresh ``single`` session (nothing retained, nothing
shared). gemma3's sliding-window layer has a window of 4, so every prompt here passes it:
its ring (batched-sequence) has overwritten early positions, and the cache refuses forks
there, which must fall back to a cold prefill.
"""
from __future__ import annotations

import pytest

from mlx_pte.serving.engine import Engine, EngineError, Request, Status

KINDS = ("batched-sequence", "batched-cell")
FAMILIES = ("llama", "qwen3", "gemma3")
SYSTEM = list(range(300, 340))  # 40 tokens: longer than a step (32), so prefill is chunked
GEN = 8


def run(engine: Engine, *requests: Request):
    handles = [engine.submit(r) for r in requests]
    engine.run()
    return handles


def greedy(prompt, max_tokens=GEN, n=1) -> Request:
    return Request(list(prompt), max_tokens=max_tokens, n=n, ignore_eos=True)


def held_tokens(prompt, tokens, max_tokens=GEN):
    """What a finished greedy sample's sequence holds: the prompt and every fed token (a
    sample ending at max_tokens never feeds its last one)."""
    return list(prompt) + list(tokens[: max_tokens - 1])


def assert_cold(oracle, family, prompt, handle, max_tokens=GEN):
    expected = oracle(prompt, max_tokens, family=family).tokens
    for sample in handle.result(timeout=0).samples:
        assert sample.tokens == expected


def first_turn(program, kind: str):
    """An engine with a prompt store, after its first request: the engine, the prompt, the handle."""
    engine = Engine(program, kind, capacity=600, max_batch_tokens=32, prompt_cache_tokens=600)
    prompt = SYSTEM + [41, 42, 43]
    (handle,) = run(engine, greedy(prompt))
    return engine, prompt, handle


def check_store(engine: Engine) -> None:
    """The store's sequences are live, hold what it says, and fit beside the reservations."""
    store = engine.prompt_store
    assert store.tokens == sum(len(e) for e in store) <= store.budget
    live = set(engine.cache.live_seqs())
    assert {e.seq_id for e in store} <= live
    for entry in store:
        assert engine.cache.pos(entry.seq_id) == len(entry)
    if engine.kind == "batched-sequence":  # cells count forks' shared prefixes in each
        assert engine.cache.usage().logical_positions <= engine.capacity


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_conversation_that_extends_a_retained_one_reuses_it_and_equals_a_cold_run(programs, oracle, kind, family):
    engine, first_prompt, first = first_turn(programs(family), kind)
    assert_cold(oracle, family, first_prompt, first)
    assert first.stats.cached_tokens == 0
    reply = first.result(timeout=0).samples[0].tokens
    held = held_tokens(first_prompt, reply)
    assert [list(e.tokens) for e in engine.prompt_store] == [held]

    second_prompt = first_prompt + reply + [44, 45, 46]
    (second,) = run(engine, greedy(second_prompt))
    assert_cold(oracle, family, second_prompt, second)
    assert second.stats.cached_tokens == len(held)
    assert engine.stats.prefix_hits == 1 and engine.stats.cached_tokens == len(held)
    # Only the new tokens were computed.
    assert engine.stats.prompt_tokens == len(first_prompt) + len(second_prompt) - len(held)
    # The longer conversation replaced the one it extends.
    assert [list(e.tokens) for e in engine.prompt_store] == [held_tokens(second_prompt, second.result().samples[0].tokens)]
    check_store(engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_conversation_resent_with_a_different_reply_tail_takes_over_its_sequence(programs, oracle, kind, family):
    engine, first_prompt, first = first_turn(programs(family), kind)
    (entry,) = engine.prompt_store
    reply = first.result(timeout=0).samples[0].tokens
    # The client resends the reply retokenized: it differs from the held one after 5 tokens.
    second_prompt = first_prompt + reply[:5] + [reply[5] + 1, 44, 45]
    handle = engine.submit(greedy(second_prompt))
    engine.step()
    # Taken over, not forked: the retained sequence is the request's own, and no other.
    assert engine.cache.live_seqs() == (entry.seq_id,)
    assert len(engine.prompt_store) == 0
    engine.run()
    assert_cold(oracle, family, second_prompt, handle)
    assert handle.stats.cached_tokens == len(first_prompt) + 5
    assert [list(e.tokens) for e in engine.prompt_store] == [
        held_tokens(second_prompt, handle.result(timeout=0).samples[0].tokens)]
    check_store(engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_that_diverges_mid_prompt_forks_the_shared_part(programs, oracle, kind, family):
    engine = Engine(programs(family), kind, capacity=600, max_batch_tokens=32, prompt_cache_tokens=600)
    run(engine, greedy(SYSTEM + [41, 42, 43]))
    for split in (35, 3):
        prompt = SYSTEM[:split] + [500 + split, 501, 502, 503]
        (handle,) = run(engine, greedy(prompt))
        assert_cold(oracle, family, prompt, handle)
        ring = family == "gemma3" and kind == "batched-sequence"
        if ring and split == 3:
            # Position 2 left the 4-wide ring long ago: the fork is refused, the prefill cold.
            assert handle.stats.cached_tokens == 0
        else:
            assert handle.stats.cached_tokens == split
        check_store(engine)


def test_retained_prompts_give_way_before_a_new_sequence_grows_the_pools(programs, oracle):
    engine = Engine(programs("llama"), "batched-sequence", capacity=600, max_batch_tokens=32,
                    prompt_cache_tokens=600)
    rows = lambda: engine.cache._pools[0].k.rows  # noqa: E731  (every layer's pools grow together)
    firsts = [[100 + i, 1, 2, 3] for i in range(3)]
    run(engine, *(greedy(p) for p in firsts))
    assert len(engine.prompt_store) == 3 and rows() == 4  # rows double: 1, 2, 4
    # The fourth row is allocated already: a cold request takes it, every entry stays.
    run(engine, greedy([200, 1, 2, 3]))
    assert len(engine.prompt_store) == 4 and rows() == 4
    # A fifth row would double the pools: the least recently used entry gives way instead.
    (handle,) = run(engine, greedy([300, 1, 2, 3]))
    assert_cold(oracle, "llama", [300, 1, 2, 3], handle)
    assert rows() == 4
    kept = sorted(int(e.tokens[0]) for e in engine.prompt_store)
    assert len(kept) == 4 and 200 in kept and 300 in kept
    check_store(engine)


@pytest.mark.parametrize("family", ("llama", "gemma3"))
@pytest.mark.parametrize("kind", KINDS)
def test_forked_samples_over_a_reused_prompt_equal_cold_runs(programs, oracle, kind, family):
    engine = Engine(programs(family), kind, capacity=600, max_batch_tokens=32, prompt_cache_tokens=600)
    first_prompt = SYSTEM + [7]
    (first,) = run(engine, greedy(first_prompt, n=2))
    assert_cold(oracle, family, first_prompt, first)
    assert len(engine.prompt_store) == 1  # two equal greedy samples: one entry
    reply = first.result(timeout=0).samples[1].tokens
    prompt = first_prompt + reply + [8, 9]
    (second,) = run(engine, greedy(prompt, n=3))
    assert_cold(oracle, family, prompt, second)
    assert second.stats.cached_tokens == len(held_tokens(first_prompt, reply))
    check_store(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_conversations_each_reuse_their_own_history(programs, oracle, kind):
    engine = Engine(programs("llama"), kind, capacity=900, max_batch_tokens=32, prompt_cache_tokens=900)
    prompts = [SYSTEM + [600 + i] for i in range(3)]
    for turn in range(3):
        handles = run(engine, *(greedy(p) for p in prompts))
        for prompt, handle in zip(prompts, handles):
            assert_cold(oracle, "llama", prompt, handle)
            if turn == 0:  # started together: the first prefills SYSTEM once, the others fork it
                assert handle.stats.cached_tokens == (0 if handle is handles[0] else len(SYSTEM))
            else:  # all but the reply's last token (never fed) and the new one
                assert handle.stats.cached_tokens == len(prompt) - 2
        prompts = [p + h.result().samples[0].tokens + [610 + turn] for p, h in zip(prompts, handles)]
        check_store(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_retained_prompts_give_way_to_a_request_that_needs_their_room(programs, oracle, kind):
    # Each prompt of 20 may grow to 20 + 12 - 1 = 31 positions; capacity 70 holds two.
    engine = Engine(programs("llama"), kind, capacity=70, max_batch_tokens=32, prompt_cache_tokens=70)
    small = [list(range(200 + 20 * i, 220 + 20 * i)) for i in range(2)]
    run(engine, *(Request(p, max_tokens=12, ignore_eos=True) for p in small))
    assert engine.prompt_store.tokens == 2 * 31  # both retained: only 8 units are left
    check_store(engine)
    big = list(range(600, 660))  # may grow to 60 + 8 - 1 = 67 units: the store must empty
    handle = engine.submit(Request(big, max_tokens=8, ignore_eos=True))
    engine.step()
    assert handle.status == Status.PREFILL and handle.waiting_reason is None
    assert len(engine.prompt_store) == 0
    engine.run()
    assert handle.result(timeout=0).samples[0].tokens == oracle(big, 8).tokens
    check_store(engine)


def test_the_budget_bounds_the_store_and_evicts_the_least_recently_used(programs):
    engine = Engine(programs("llama"), "batched-cell", capacity=600, max_batch_tokens=32, prompt_cache_tokens=50)
    a, b, c = ([i] * 5 + list(range(100 + i, 115 + i)) for i in (1, 2, 3))  # 20 tokens, 27 held
    run(engine, greedy(a))
    run(engine, greedy(b))  # 54 > 50: a goes
    assert [int(e.tokens[0]) for e in engine.prompt_store] == [2]
    run(engine, greedy(c))
    assert [int(e.tokens[0]) for e in engine.prompt_store] == [3]
    too_long = list(range(700, 760))  # its sequence alone exceeds the budget: not kept
    run(engine, greedy(too_long))
    assert [int(e.tokens[0]) for e in engine.prompt_store] == [3]
    check_store(engine)


def test_a_cancelled_request_is_not_retained(programs):
    engine = Engine(programs("llama"), "batched-cell", capacity=600, max_batch_tokens=32, prompt_cache_tokens=600)
    handle = engine.submit(greedy(SYSTEM, max_tokens=50))
    for _ in range(4):
        engine.step()
    handle.cancel()
    engine.run()
    assert handle.status == Status.CANCELLED
    assert len(engine.prompt_store) == 0 and engine.cache.live_seqs() == ()


def test_zero_disables_the_store_and_bad_budgets_are_refused(programs):
    engine = Engine(programs("llama"), "batched-cell", capacity=600, prompt_cache_tokens=0)
    run(engine, greedy(SYSTEM))
    assert engine.cache.live_seqs() == () and len(engine.prompt_store) == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(EngineError, match="prompt_cache_tokens"):
            Engine(programs("llama"), "batched-cell", capacity=600, prompt_cache_tokens=bad)


@pytest.mark.parametrize("family", ("llama", "gemma3"))
@pytest.mark.parametrize("kind", KINDS)
def test_a_sample_stopped_a_step_late_is_retained_as_the_caller_saw_it(programs, oracle, kind, family):
    # A stop token is read after the next step fed it: the sequence holds one position
    # the caller never saw, which must be rewound before the sequence is kept.
    engine = Engine(programs(family), kind, capacity=600, max_batch_tokens=32, prompt_cache_tokens=600)
    prompt = SYSTEM + [9]
    cold = oracle(prompt, 20, family=family).tokens
    stop = cold[5]
    (first,) = run(engine, Request(prompt, max_tokens=20, stop_ids=(stop,), ignore_eos=True))
    seen = first.result(timeout=0).samples[0].tokens
    assert seen == cold[: cold.index(stop) + 1]
    assert [list(e.tokens) for e in engine.prompt_store] == [prompt + seen]
    extended = prompt + seen + [10, 11]
    (second,) = run(engine, greedy(extended))
    assert_cold(oracle, family, extended, second)
    assert second.stats.cached_tokens == len(prompt + seen)
    check_store(engine)
