"""generate() against a plain one-forward-per-token loop over the same Session API."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlx_pte.export.hf_export import export_hf
from mlx_pte import Session, generate, load
from mlx_pte.serving.generation import GenerationError
from mlx_pte.serving.sampling.params import SamplingParams

PROMPT = [5, 17, 99, 3, 250, 42, 7]


@pytest.fixture(scope="module")
def program(tiny_checkpoint, tmp_path_factory):
    pte = export_hf(tiny_checkpoint("gemma3"), tmp_path_factory.mktemp("gen") / "m.pte", max_step=4, progress=False)
    return load(pte)


def stepwise_greedy(program, kind: str, n: int) -> tuple[list[int], int]:
    """Greedy decoding one synchronous forward at a time; returns tokens and the cache's end."""
    session = Session(program, kind=kind, capacity=64)
    seq = session.cache.seq_new()
    logits = None
    for at in range(0, len(PROMPT), 4):
        logits = session.forward(PROMPT[at : at + 4], seq_ids=seq)
    tokens = [int(np.argmax(np.array(logits[0])))]
    while len(tokens) < n:
        logits = session.forward([tokens[-1]], seq_ids=seq)
        tokens.append(int(np.argmax(np.array(logits[0]))))
    return tokens, session.cache.pos(seq)


@pytest.mark.parametrize("kind", ["single", "batched-sequence"])
def test_pipelined_greedy_equals_stepwise_and_leaves_the_same_cache(program, kind):
    want, want_end = stepwise_greedy(program, kind, 12)
    session = Session(program, kind=kind, capacity=64)
    got = generate(session, PROMPT, max_new_tokens=12, stop_on_eos=False)
    assert got.tokens == want and got.finish_reason == "length"
    assert session.cache.usage().logical_positions == 0  # its fresh sequence is removed
    seq = session.cache.seq_new()
    kept = generate(session, PROMPT, max_new_tokens=12, stop_on_eos=False, seq_id=seq)
    assert kept.tokens == want
    # The last token is never written, as in the stepwise loop.
    assert session.cache.pos(seq) == want_end == len(PROMPT) + 11


def test_an_end_of_sequence_stops_and_rewinds_the_step_launched_past_it(program):
    """The cache ends where the stepwise loop's does: the end-of-sequence token, which the
    step launched ahead of it fed, is not kept."""
    want, _ = stepwise_greedy(program, "batched-sequence", 12)
    stop = want.index(want[6])  # the first time the seventh token comes
    session = Session(program, kind="batched-sequence", capacity=64)
    session.manifest = dataclasses.replace(session.manifest, eos_token_ids=(want[6],))
    seq = session.cache.seq_new()
    got = generate(session, PROMPT, max_new_tokens=12, seq_id=seq)
    assert got.tokens == want[: stop + 1] and got.finish_reason == "eos"
    assert session.cache.pos(seq) == len(PROMPT) + stop
    # What the cache kept is right, not just its length: it continues as a cold run does.
    after = generate(session, [8, 9], max_new_tokens=3, stop_on_eos=False, seq_id=seq)
    cold = generate(Session(program, kind="batched-sequence", capacity=64), PROMPT + want[:stop] + [8, 9],
                    max_new_tokens=3, stop_on_eos=False)
    assert after.tokens == cold.tokens


@pytest.mark.parametrize("kind", ["single", "batched-sequence"])
def test_a_given_sequence_is_continued(program, kind):
    """A second prompt on a kept sequence follows what it holds: the same as one run over
    the first prompt, the reply the cache holds, and the second prompt."""
    session = Session(program, kind=kind, capacity=64)
    seq = session.cache.seq_new()
    first = generate(session, PROMPT, max_new_tokens=4, stop_on_eos=False, seq_id=seq)
    second = generate(session, [8, 9], max_new_tokens=4, stop_on_eos=False, seq_id=seq)
    whole = PROMPT + first.tokens[:-1] + [8, 9]  # its last token was never fed
    alone = generate(Session(program, kind=kind, capacity=64), whole, max_new_tokens=4, stop_on_eos=False)
    assert second.tokens == alone.tokens


def test_a_single_cache_in_use_is_refused_with_the_way_out(program):
    session = Session(program, capacity=64)
    session.forward(PROMPT[:4])  # sequence 0 needs no seq_new
    with pytest.raises(GenerationError, match=r"seq_rm\(0\)"):
        generate(session, PROMPT, max_new_tokens=2)


def test_capacity_stops_generation_with_the_reason(program):
    session = Session(program, capacity=len(PROMPT) + 3)
    got = generate(session, PROMPT, max_new_tokens=20, stop_on_eos=False)
    assert got.finish_reason == "capacity" and len(got.tokens) == 4
    with pytest.raises(GenerationError, match="does not fit"):
        generate(Session(program, capacity=len(PROMPT) - 1), PROMPT, max_new_tokens=2)


def test_sampled_generation_repeats_per_seed(program):
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    a = generate(Session(program, capacity=64), PROMPT, max_new_tokens=10, sampling=params, stop_on_eos=False)
    b = generate(Session(program, capacity=64), PROMPT, max_new_tokens=10, sampling=params, stop_on_eos=False)
    assert a.tokens == b.tokens
