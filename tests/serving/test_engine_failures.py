"""A failure while serving one request ends that request only.

Three well-formed requests share every step with a poisoned one; whatever fails (the
forward, sampling, detokenizing or the stop check), the three must produce exactly what
single-sequence ``generate()`` gives them alone, and the cache must end as it began.
"""
from __future__ import annotations

import numpy as np
import pytest

from mlx_pte.runtime.cache import CacheRefused
from mlx_pte.runtime.mlx.launcher import evaluate
from mlx_pte.serving.engine import Engine, Request, Status
from mlx_pte.serving.sampling import device as device_sampling
from mlx_pte.serving.sampling.params import GREEDY_TEMPERATURE, SamplingParams

GOOD = ([17, 18, 19], [40, 41, 42, 43, 44], list(range(100, 140)))
POISON = [7, 300, 9, 301]
POISON_TOKEN = 301  # the forward "fails" on any step carrying this token
MAX_TOKENS = 6


def run_with(engine: Engine, poisoned: Request):
    before = (engine.cache.usage(), engine.cache.live_seqs())
    good = [engine.submit(Request(p, max_tokens=MAX_TOKENS, ignore_eos=True)) for p in GOOD[:2]]
    bad = engine.submit(poisoned)
    good.append(engine.submit(Request(GOOD[2], max_tokens=MAX_TOKENS, ignore_eos=True)))
    while engine.has_work:
        engine.step()
        assert sorted(s.seq_id for s in engine.sequences()) == sorted(engine.cache.live_seqs())
    assert (engine.cache.usage().logical_positions, engine.cache.live_seqs()) == (
        before[0].logical_positions, before[1])
    return good, bad


def check_good(good, oracle):
    for handle, prompt in zip(good, GOOD):
        assert handle.status == Status.DONE, handle.error
        assert handle.result(timeout=0).samples[0].tokens == oracle(prompt, MAX_TOKENS).tokens


@pytest.fixture(params=["batched-sequence", "batched-cell"])
def engine(request, program):
    return Engine(program, request.param, capacity=400, max_batch_tokens=64)


def test_a_forward_that_fails_on_one_request_fails_only_that_request(engine, program, oracle, monkeypatch):
    real_run = program.run
    calls = {"failed": 0}

    def run(inputs, **kwargs):
        evaluate([inputs[0]])  # the tokens fed from the last step are lazy
        if POISON_TOKEN in np.asarray(inputs[0]).reshape(-1).tolist():
            calls["failed"] += 1
            raise RuntimeError("poisoned step")
        return real_run(inputs, **kwargs)

    monkeypatch.setattr(program, "run", run)
    good, bad = run_with(engine, Request(POISON, max_tokens=MAX_TOKENS))
    assert calls["failed"] >= 2  # the shared step, then the poisoned request alone
    assert bad.status == Status.FAILED and "poisoned step" in bad.error
    assert list(bad.events(timeout=0))[-1].error == bad.error
    check_good(good, oracle)


def test_a_transient_forward_failure_fails_nobody(engine, program, oracle, monkeypatch):
    real_run = program.run
    state = {"calls": 0}

    def run(inputs, **kwargs):
        state["calls"] += 1
        if state["calls"] == 2:  # the second step (everyone decoding or prefilling) fails once
            raise RuntimeError("device hiccup")
        return real_run(inputs, **kwargs)

    monkeypatch.setattr(program, "run", run)
    good, bad = run_with(engine, Request(POISON, max_tokens=MAX_TOKENS, ignore_eos=True))
    check_good(good, oracle)
    assert bad.status == Status.DONE
    assert bad.result(timeout=0).samples[0].tokens == oracle(POISON, MAX_TOKENS).tokens


@pytest.mark.parametrize("where", ["sampler", "stop check", "first token"])
def test_a_failure_after_the_forward_fails_only_its_request(engine, oracle, monkeypatch, where):
    real_draw = device_sampling.draw
    poisoned = Request(POISON, max_tokens=MAX_TOKENS, ignore_eos=True,
                       sampling=SamplingParams(temperature=1.0, seed=99))
    tokens_seen = {"n": 0}

    def draw(logits, streams, rows=None):
        if any(s.params.seed == 99 for s in streams):
            tokens_seen["n"] += 1
            if where == "first token" or tokens_seen["n"] >= 3:
                raise FloatingPointError("poisoned sampler")
        return real_draw(logits, streams, rows)

    if where == "stop check":
        from mlx_pte.serving.text import stops

        real_push = stops.StopText.push

        def push(self, piece):
            if self.stops.strings == ("never appears",):
                raise UnicodeError("poisoned stop check")
            return real_push(self, piece)

        monkeypatch.setattr(stops.StopText, "push", push)
        poisoned = Request(POISON, max_tokens=MAX_TOKENS, ignore_eos=True, stop=("never appears",))
    else:
        monkeypatch.setattr(device_sampling, "draw", draw)
    good, bad = run_with(engine, poisoned)
    assert bad.status == Status.FAILED and "poisoned" in bad.error
    check_good(good, oracle)


@pytest.mark.parametrize("error", [RuntimeError("[malloc] out of memory"), CacheRefused("no sequence is free")],
                         ids=["device", "cache"])
def test_a_fork_that_fails_fails_only_its_request(engine, oracle, monkeypatch, error):
    """A request of several samples forks its prompt once the prompt is in; a fork that
    fails (the device out of memory, the cache refusing) ends that request alone, and the
    requests sharing its step lose no token."""
    real_clone = engine.cache.seq_clone
    clones = {"failed": 0}

    def seq_clone(src, upto):
        if upto == len(POISON):
            clones["failed"] += 1
            raise error
        return real_clone(src, upto)

    monkeypatch.setattr(engine.cache, "seq_clone", seq_clone)
    good, bad = run_with(engine, Request(POISON, max_tokens=MAX_TOKENS, ignore_eos=True, n=3,
                                         sampling=SamplingParams(temperature=1.0, seed=5)))
    assert clones["failed"] == 1
    assert bad.status == Status.FAILED and "forking the prompt" in bad.error and str(error) in bad.error
    check_good(good, oracle)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, GREEDY_TEMPERATURE / 2, 0.0])
def test_tiny_temperatures_are_greedy(program, oracle, temperature):
    engine = Engine(program, "batched-sequence", capacity=400)
    handle = engine.submit(Request(GOOD[1], max_tokens=MAX_TOKENS, ignore_eos=True,
                                   sampling=SamplingParams(temperature=temperature, seed=3)))
    engine.run()
    assert handle.result(timeout=0).samples[0].tokens == oracle(GOOD[1], MAX_TOKENS).tokens
