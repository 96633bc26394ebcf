"""Structured output and logprobs through the batching engine.

Oracles: HF's eager PyTorch forward of the same checkpoint (log-softmax of its logits),
single-sequence ``generate()`` for free requests batched with constrained ones, and
``jsonschema`` for constrained replies.
"""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_pte.serving.engine import Engine, Request
from mlx_pte.serving.sampling.grammar import Grammar, TokenVocabulary, masks
from mlx_pte.serving.sampling.logprobs import TokenLogprob
from mlx_pte.serving.sampling.params import SamplingParams
from tests.fixtures.json_schemas import SCHEMAS, short_schemas
from tests.fixtures.reference_logprobs import hf_logprobs, hf_model  # noqa: F401  (a fixture)
from tests.fixtures.tiny_models import EOS_ID, VOCAB_SIZE


@pytest.fixture
def engine(program):
    return Engine(program, "batched-cell", capacity=1500, max_batch_tokens=24)


def run(engine, *requests):
    handles = [engine.submit(r) for r in requests]
    engine.run()
    return [h.result(timeout=0) for h in handles]


def check_logprobs(records: tuple[TokenLogprob, ...], tokens: list[int], reference: np.ndarray, k: int) -> None:
    """``records`` of ``tokens`` against reference log-probabilities (row i: token i's)."""
    assert [r.token for r in records] == tokens
    for record, row in zip(records, reference):
        np.testing.assert_allclose(record.logprob, row[record.token], atol=2e-5)
        assert len(record.top) == k
        np.testing.assert_allclose([v for _, v in record.top], row[[t for t, _ in record.top]], atol=2e-5)
        kth = np.sort(row)[-k] if k else np.inf
        assert all(row[t] >= kth - 2e-5 for t, _ in record.top)  # the k most likely, up to ties


def test_logprobs_are_the_log_softmax_of_the_reference_logits(engine, hf_model, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("def main():")
    greedy, sampled = run(
        engine,
        Request(prompt, max_tokens=8, ignore_eos=True, logprobs=5),
        # Sampled at a high temperature: the figures are the model's distribution still.
        Request(prompt, max_tokens=8, ignore_eos=True, logprobs=2, sampling=SamplingParams(temperature=1.7, seed=4)),
    )
    for completion, k in ((greedy, 5), (sampled, 2)):
        (sample,) = completion.samples
        reference = hf_logprobs(hf_model, prompt + sample.tokens)[len(prompt) - 1 : -1]
        check_logprobs(sample.logprobs, sample.tokens, reference, k)
    # Greedy picks the most likely token, so it tops its own list.
    assert all(r.top[0][0] == r.token for r in greedy.samples[0].logprobs)


def test_constrained_and_free_requests_share_batches(engine, oracle, tiny_tokenizer):
    prompts = ["The quick brown", "import os", "x = 1", "hello there"]
    free = [Request(tiny_tokenizer.encode(p), max_tokens=12, ignore_eos=True) for p in prompts[:2]]
    constrained = [
        Request(tiny_tokenizer.encode(p), max_tokens=150, grammar=Grammar.json_schema(schema),
                sampling=SamplingParams(temperature=0.9, seed=i))
        for i, (p, schema) in enumerate(zip(prompts * 2, SCHEMAS))
    ]
    results = run(engine, *(constrained[:2] + free + constrained[2:]))
    assert engine.stats.mean_decode_batch > 2  # they decoded together
    for request, completion in zip(free, results[2:4]):
        assert completion.samples[0].tokens == oracle(request.prompt, 12).tokens
    for completion, schema in zip(results[:2] + results[4:], SCHEMAS):
        (sample,) = completion.samples
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), schema)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(short_schemas, min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_replies_to_generated_schemas_validate(engine, tiny_tokenizer, schemas, seed):
    requests = [Request(tiny_tokenizer.encode(f"item {i}:"), max_tokens=200, grammar=Grammar.json_schema(schema),
                        sampling=SamplingParams(temperature=1.0, seed=seed + i)) for i, schema in enumerate(schemas)]
    for completion, schema in zip(run(engine, *requests), schemas):
        (sample,) = completion.samples
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), schema)


def test_every_sample_of_n_follows_the_grammar(engine, tiny_tokenizer):
    (completion,) = run(engine, Request(tiny_tokenizer.encode("hi"), max_tokens=150, n=3,
                                        grammar=Grammar.json_schema(SCHEMAS[1]),
                                        sampling=SamplingParams(temperature=1.0, seed=7)))
    texts = [s.text for s in completion.samples]
    assert len(set(texts)) > 1  # samples of their own
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_a_complete_match_ends_the_sample_even_ignoring_eos(engine, tiny_tokenizer):
    (completion,) = run(engine, Request(tiny_tokenizer.encode("answer:"), max_tokens=20, ignore_eos=True,
                                        grammar=Grammar.regex("(yes|no)")))
    (sample,) = completion.samples
    assert sample.text in ("yes", "no") and sample.finish_reason == "stop"


def test_constrained_logprobs_are_over_the_tokens_the_grammar_allows(engine, hf_model, tiny_tokenizer):
    grammar = Grammar.json_schema(SCHEMAS[0])
    prompt = tiny_tokenizer.encode("person:")
    (completion,) = run(engine, Request(prompt, max_tokens=150, grammar=grammar, logprobs=20))
    (sample,) = completion.samples
    vocabulary = TokenVocabulary(tiny_tokenizer.backend_tokenizer.to_str(), VOCAB_SIZE, [EOS_ID])
    walker = vocabulary.matcher(grammar)
    reference = hf_logprobs(hf_model, prompt + sample.tokens)[len(prompt) - 1 :]
    restricted = []
    for i, row in enumerate(reference[: len(sample.tokens)]):
        (words,) = masks([walker], VOCAB_SIZE)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB_SIZE].astype(bool)
        masked = np.where(allowed, row, -np.inf)
        restricted.append(masked - np.logaddexp.reduce(masked[allowed]))
        if sample.tokens[i] != EOS_ID:
            walker.consume(sample.tokens[i])
    finite = [[(t, v) for t, v in r.top if np.isfinite(v)] for r in sample.logprobs]
    for record, row, top in zip(sample.logprobs, restricted, finite):
        np.testing.assert_allclose(record.logprob, row[record.token], atol=2e-5)
        np.testing.assert_allclose([v for _, v in top], row[[t for t, _ in top]], atol=2e-5)
        assert len(top) == min(20, int(np.isfinite(row).sum()))
