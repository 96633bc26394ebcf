"""Warming the engine up traces every bucket its steps can take: afterwards a workload of
mixed arrivals compiles nothing, and its greedy outputs still equal single-sequence runs."""
from __future__ import annotations

import pytest

from mlx_pte.serving.engine import Engine, EngineError, Request

from tests.serving.test_engine import PROMPTS

KINDS = ("batched-sequence", "batched-cell")


@pytest.mark.parametrize("kind", KINDS)
def test_after_warm_up_a_mixed_workload_compiles_nothing(program, oracle, kind):
    engine = Engine(program, kind, capacity=400, max_batch_tokens=24)
    assert engine.warm_up() >= 0
    assert engine.cache.live_seqs() == ()  # the scratch sequences are gone
    traced = program.compilations
    handles = [engine.submit(Request(p, max_tokens=10, ignore_eos=True)) for p in PROMPTS[:2]]
    for _ in range(3):
        engine.step()
    handles += [engine.submit(Request(p, max_tokens=10, n=2, ignore_eos=True)) for p in PROMPTS[2:]]
    engine.run()
    assert program.compilations == traced
    for prompt, handle in zip(PROMPTS, handles):
        expected = oracle(prompt, 10).tokens
        assert [s.tokens for s in handle.result(timeout=0).samples] == [expected] * handle.request.n


def test_warm_up_refuses_an_engine_holding_requests(program):
    engine = Engine(program, "batched-sequence", capacity=200, max_batch_tokens=16)
    engine.submit(Request([1, 2, 3], max_tokens=2))
    with pytest.raises(EngineError, match="before submitting"):
        engine.warm_up()


@pytest.mark.parametrize("launch", ["inline", "thread"])
def test_a_started_engine_warms_up_on_its_worker_so_served_requests_compile_nothing(program, launch):
    """``serve`` starts the engine, then warms it up: MLX keeps compiled graphs per thread,
    so the warm-up must trace on the worker thread that runs the steps."""
    from mlx_pte import Session, generate

    generate(Session(program, capacity=64), [3, 4, 5], 3)  # this thread traces a bucket first
    engine = Engine(program, "batched-sequence", capacity=400, max_batch_tokens=24, launch=launch)
    engine.start()
    try:
        engine.warm_up()
        traced = program.compilations
        handles = [engine.submit(Request(p, max_tokens=6, ignore_eos=True)) for p in PROMPTS]
        for handle in handles:
            handle.result(timeout=60)
    finally:
        engine.stop()
    assert program.compilations == traced
