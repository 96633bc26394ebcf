"""Steps launched on a thread of their own (``launch="thread"``) give exactly what steps
launched inline give, through ``generate`` and through the engine: the oracle is the same
work launched inline (itself held to single-sequence runs and HF by the other tests)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.program import load
from mlx_pte.interpreter.session import SessionError
from mlx_pte.serving.engine import Engine, Request
from mlx_pte.serving.generation import generate
from mlx_pte.serving.sampling.grammar import Grammar
from mlx_pte.serving.sampling.params import SamplingParams
from tests.fixtures.tiny_models import EOS_ID

PROMPTS = ([17], [40, 41, 42, 43, 44], list(range(100, 140)), [7, 300, 9, 301, 11, 302, 13])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generate_on_a_launcher_thread_equals_the_single_sequence_oracle(program, oracle, prompt):
    session = program.session("single", launch="thread")
    result = generate(session, prompt, 24, stop_on_eos=False)
    assert result.tokens == oracle(prompt, 24).tokens


def test_generate_on_a_launcher_thread_stops_at_eos_and_rewinds(program):
    runs = {}
    for launch in ("inline", "thread"):
        session = program.session("single", launch=launch)
        result = generate(session, list(range(60, 70)), 40, stop_on_eos=True)
        runs[launch] = (result.tokens, result.finish_reason, session.cache.live_seqs())
    assert runs["thread"] == runs["inline"]


@pytest.fixture(scope="module")
def bfloat16_pte(tmp_path_factory, tiny_checkpoint):
    """The llama tiny checkpoint in bfloat16, whose weights load as views of their bits."""
    path = tmp_path_factory.mktemp("bf16") / "llama.pte"
    return export_hf(tiny_checkpoint("llama"), path, dtype="bfloat16", max_step=64, progress=False)


@pytest.mark.parametrize("kind", ["single", "batched-cell"])
def test_a_freshly_loaded_bfloat16_program_runs_first_on_a_launcher_thread(bfloat16_pte, kind):
    """Nothing the loading thread made lazily reaches the launcher's thread, which cannot
    encode another thread's stream: the first step of a fresh load runs there."""
    prompt = list(range(30, 42))
    tokens = {}
    for launch in ("thread", "inline"):
        if kind == "single":
            session = load(bfloat16_pte).session("single", launch=launch)
            tokens[launch] = generate(session, prompt, 8, stop_on_eos=False).tokens
        else:
            engine = Engine(load(bfloat16_pte), kind, capacity=128, launch=launch)
            handle = engine.submit(Request(prompt, max_tokens=8, ignore_eos=True))
            engine.run()
            tokens[launch] = handle.result(timeout=0).samples[0].tokens
    assert tokens["thread"] == tokens["inline"]


def test_a_session_refuses_an_unknown_launch_mode(program):
    with pytest.raises(SessionError, match="launch must be one of inline, thread"):
        program.session("single", launch="async")


def _outcome(result):
    return [(s.tokens, s.finish_reason, [(r.token, round(r.logprob, 5)) for r in s.logprobs])
            for s in result.samples]


def run_both(program, requests, arrive_after=(), prompt_cache_tokens=0, kind="batched-sequence"):
    """Each request's samples (tokens, finish reason, logprobs) on an inline-launched and a
    thread-launched engine; ``arrive_after[i]`` steps pass before request ``i`` arrives."""
    outcomes = {}
    for launch in ("inline", "thread"):
        engine = Engine(program, kind, capacity=900, max_batch_tokens=32,
                        prompt_cache_tokens=prompt_cache_tokens, launch=launch)
        delays = list(arrive_after) + [0] * (len(requests) - len(arrive_after))
        handles, step = [], 0
        pending = sorted(range(len(requests)), key=lambda i: delays[i])
        while pending or engine.has_work:
            while pending and delays[pending[0]] <= step:
                handles.append((pending[0], engine.submit(requests[pending.pop(0)])))
            engine.step()
            step += 1
        outcomes[launch] = {i: _outcome(h.result(timeout=0)) for i, h in handles}
    return outcomes["inline"], outcomes["thread"]


@pytest.mark.parametrize("kind", ["batched-sequence", "batched-cell"])
def test_the_engine_on_a_launcher_thread_equals_inline(program, tiny_tokenizer, kind):
    """Mixed arrivals, chunked prompts, n > 1 samples (forks), seeded sampling, logprobs, a
    grammar (masks after reading the previous step) and a shared prompt prefix."""
    shared = list(range(200, 236))
    requests = [
        Request(PROMPTS[2], max_tokens=12, ignore_eos=True),
        Request(PROMPTS[1], max_tokens=10, n=3, sampling=SamplingParams(temperature=0.9, seed=3)),
        Request(tiny_tokenizer.encode("answer:"), max_tokens=20, grammar=Grammar.regex("(yes|no)")),
        Request(shared + [1, 2], max_tokens=8, logprobs=3, ignore_eos=True),
        Request(shared + [5], max_tokens=8, ignore_eos=True),
    ]
    inline, thread = run_both(program, requests, arrive_after=[0, 0, 2, 3, 3], prompt_cache_tokens=900, kind=kind)
    assert thread == inline


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 45), st.integers(1, 14), st.integers(1, 2),
                          st.booleans()), min_size=1, max_size=5))
def test_random_workloads_on_a_launcher_thread_equal_inline(program, workload):
    """Arrival step, prompt length, max tokens, n and eos handling drawn at random."""
    requests = [
        Request([(7 * i + 3 * j) % 500 + 3 for j in range(length)], max_tokens=tokens, n=n,
                ignore_eos=not stop, sampling=SamplingParams(temperature=0.8, seed=i) if n > 1 else SamplingParams(),
                stop_ids=[EOS_ID])
        for i, (_, length, tokens, n, stop) in enumerate(workload)
    ]
    inline, thread = run_both(program, requests, arrive_after=[w[0] for w in workload])
    assert thread == inline
