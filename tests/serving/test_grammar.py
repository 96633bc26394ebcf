"""The grammar API and the device-side mask, against brute-force oracles.

Masks: ``token_masks.apply_masks`` against a per-token numpy reading of the packed words.
Grammars: a finite regular language's first-token mask against the vocabulary scanned by
hand; random walks (each step a uniformly random allowed token, eos included where
allowed) over generated schemas end in text that ``json.loads`` parses and ``jsonschema``
validates, with eos allowed exactly where the matcher accepts.
"""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx.core as mx

from mlx_pte.serving.sampling.grammar import Grammar, GrammarError, TokenVocabulary, json_schema_rule, mask_words, masks
from mlx_pte.serving.sampling.token_masks import apply_masks
from tests.fixtures.json_schemas import short_schemas
from tests.fixtures.tiny_models import EOS_ID, VOCAB_SIZE


def _bit(words: np.ndarray, token: int) -> bool:
    return (int(words[token // 32]) & 0xFFFFFFFF) >> (token % 32) & 1 == 1


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 100), seed=st.integers(0, 2**32 - 1))
def test_apply_masks_matches_a_per_token_reading_of_the_words(rows, vocab, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    packed = rng.integers(-(2**31), 2**31, size=(rows, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    expected = np.array(
        [[logits[r, t] if _bit(packed[r], t) else -np.inf for t in range(vocab)] for r in range(rows)],
        dtype=np.float32,
    )
    got = np.array(apply_masks(mx.array(logits), packed))
    np.testing.assert_array_equal(got, expected)


def test_apply_masks_needs_one_row_per_row_of_logits():
    with pytest.raises(ValueError, match="2 mask rows for 3 rows"):
        apply_masks(mx.zeros((3, 40)), np.zeros((2, 2), dtype=np.int32))


@pytest.fixture(scope="module")
def vocabulary(tiny_tokenizer):
    return TokenVocabulary(tiny_tokenizer.backend_tokenizer.to_str(), VOCAB_SIZE, [EOS_ID])


@pytest.fixture(scope="module")
def token_text(vocabulary):
    return [vocabulary.token_bytes(t) for t in range(VOCAB_SIZE)]


def _allowed(vocabulary, matcher) -> set[int]:
    (row,) = masks([matcher], vocabulary.vocab_size)
    return {t for t in range(vocabulary.vocab_size) if _bit(row, t)}


def test_first_mask_of_a_finite_language_is_every_token_that_prefixes_a_word(vocabulary, token_text):
    words = [b"yes", b"no", b"maybe"]
    matcher = vocabulary.matcher(Grammar.regex("(yes|no|maybe)"))
    expected = {t for t, text in enumerate(token_text) if text and any(w.startswith(text) for w in words)}
    assert _allowed(vocabulary, matcher) == expected


def test_eos_is_allowed_only_once_the_text_is_complete(vocabulary, tiny_tokenizer):
    matcher = vocabulary.matcher(Grammar.regex("ab+"))
    assert EOS_ID not in _allowed(vocabulary, matcher)
    for token in tiny_tokenizer.encode("ab", add_special_tokens=False):
        matcher.consume(token)
    assert matcher.accepting and not matcher.done
    assert EOS_ID in _allowed(vocabulary, matcher)


def test_a_forbidden_token_is_refused(vocabulary, tiny_tokenizer):
    matcher = vocabulary.matcher(Grammar.regex("[0-9]+"))
    (letter,) = tiny_tokenizer.encode("x", add_special_tokens=False)
    with pytest.raises(GrammarError, match=f"token {letter} is not allowed"):
        matcher.consume(letter)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Grammar.json_schema({"type": "strang"}), "Invalid type: strang"),
        (lambda: Grammar.json_schema({"type": "string", "format": "weird"}), "Unknown format: weird"),
        (lambda: Grammar.json_schema(["not", "an", "object"]), "must be an object"),
        (lambda: Grammar.regex("a[b"), "unclosed character class"),
        (lambda: Grammar.lark("start: missing_rule"), "missing_rule"),
    ],
)
def test_grammars_the_engine_cannot_use_are_errors_naming_the_problem(build, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        build()


def test_a_panic_inside_the_engine_is_a_grammar_error():
    # llguidance 1.9 panics cutting its error message inside a character (byte 100 here).
    with pytest.raises(GrammarError, match="the JSON schema cannot be used"):
        Grammar.json_schema({"minLength": "a" * 96 + "é" * 5})


def _walk(vocabulary, matcher, rng, limit=600) -> list[int]:
    """Uniformly random allowed tokens until eos (or the grammar is done); eos is never
    part of the returned tokens."""
    tokens: list[int] = []
    for _ in range(limit):
        allowed = _allowed(vocabulary, matcher)
        assert (EOS_ID in allowed) == matcher.accepting
        if matcher.done:
            assert allowed == {EOS_ID}
            return tokens
        token = int(rng.choice(sorted(allowed)))
        if token == EOS_ID:
            return tokens
        matcher.consume(token)
        tokens.append(token)
    raise AssertionError(f"no end after {limit} tokens")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=short_schemas, seed=st.integers(0, 2**32 - 1))
def test_random_walks_over_a_schema_end_in_valid_instances(vocabulary, tiny_tokenizer, schema, seed):
    matcher = vocabulary.matcher(Grammar.json_schema(schema))
    tokens = _walk(vocabulary, matcher, np.random.default_rng(seed))
    text = tiny_tokenizer.decode(tokens)
    jsonschema.validate(json.loads(text), schema)


def test_random_walks_over_json_object_are_objects(vocabulary, tiny_tokenizer):
    rng = np.random.default_rng(0)
    ended = 0
    for _ in range(5):
        try:
            tokens = _walk(vocabulary, vocabulary.matcher(Grammar.json_object()), rng, limit=200)
        except AssertionError:  # unbounded strings: a random walk may go on
            continue
        ended += 1
        assert isinstance(json.loads(tiny_tokenizer.decode(tokens)), dict)
    assert ended


def test_a_lark_grammar_embeds_a_schema_between_fixed_text(vocabulary, tiny_tokenizer):
    arguments = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                 "additionalProperties": False}
    grammar = Grammar.lark(f'start: "<tool_call>" call "</tool_call>"\ncall: {json_schema_rule(arguments)}')
    for seed in range(3):
        tokens = _walk(vocabulary, vocabulary.matcher(grammar), np.random.default_rng(seed))
        text = tiny_tokenizer.decode(tokens)
        match = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, flags=re.S)
        assert match, text
        jsonschema.validate(json.loads(match.group(1)), arguments)
