"""Logprobs and structured output through the official ``openai`` client against a live
server on 127.0.0.1.

Oracles: HF's eager PyTorch forward (log-softmax of its logits at each position of the
greedy continuation, which single-sequence ``generate()`` gives) for logprobs;
``jsonschema`` for structured replies.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import openai
import pytest

from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.manifest import Manifest
from mlx_pte.serving.openai.app import create_app
from mlx_pte.serving.engine import Engine
from tests.fixtures.json_schemas import SCHEMAS
from tests.fixtures.reference_logprobs import hf_logprobs, hf_model  # noqa: F401  (a fixture)
from tests.serving.live_server import serving

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def served(program):
    engine = Engine(program, "batched-cell", capacity=2400, max_batch_tokens=32)
    with serving(create_app(engine, MODEL)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0), engine
    assert engine.cache.live_seqs() == ()


@pytest.fixture
def client(served):
    return served[0]


@pytest.fixture(scope="module")
def chat_prompt(program):
    codec = TextCodec(Manifest.from_dict(program.manifest))
    return codec.render_chat(MESSAGES)


def reference_rows(hf_model, tiny_tokenizer, oracle, prompt: str, n: int):  # noqa: F811
    """The greedy continuation of ``prompt`` (``generate()``) and HF's log-probabilities
    of the position before each of its tokens."""
    prompt_ids = tiny_tokenizer.encode(prompt)
    tokens = oracle(prompt, n).tokens
    return tokens, hf_logprobs(hf_model, prompt_ids + tokens)[len(prompt_ids) - 1 : -1]


def check_top(values: list[float], row: np.ndarray) -> None:
    """The reported top values are the row's largest, most likely first."""
    assert values == sorted(values, reverse=True)
    np.testing.assert_allclose(values, np.sort(row)[::-1][: len(values)], atol=2e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_log_softmax_of_the_reference(client, hf_model, tiny_tokenizer, oracle,  # noqa: F811
                                                           chat_prompt, stream):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
              extra_body={"ignore_eos": True})
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    tokens, rows = reference_rows(hf_model, tiny_tokenizer, oracle, chat_prompt, 6)
    assert b"".join(bytes(entry.bytes) for entry in content) == tiny_tokenizer.decode(tokens).encode()
    for entry, token, row in zip(content, tokens, rows, strict=True):
        np.testing.assert_allclose(entry.logprob, row[token], atol=2e-5)
        assert len(entry.top_logprobs) == 5
        check_top([top.logprob for top in entry.top_logprobs], row)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_in_the_legacy_shape(client, hf_model, tiny_tokenizer, oracle, stream):  # noqa: F811
    prompt = "def main():"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    if stream:
        tokens_text, logprobs, tops, offsets = [], [], [], []
        for chunk in client.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                lp = chunk.choices[0].logprobs
                tokens_text += lp.tokens
                logprobs += lp.token_logprobs
                tops += lp.top_logprobs
                offsets += lp.text_offset
    else:
        choice = client.completions.create(**kw).choices[0]
        lp = choice.logprobs
        tokens_text, logprobs, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
        assert choice.text == "".join(tokens_text)
    tokens, rows = reference_rows(hf_model, tiny_tokenizer, oracle, prompt, 6)
    assert len(tokens_text) == len(tokens)
    assert offsets == [len("".join(tokens_text[:i])) for i in range(len(tokens_text))]
    for value, top, token, row in zip(logprobs, tops, tokens, rows, strict=True):
        np.testing.assert_allclose(value, row[token], atol=2e-5)
        if len(top) == 3:  # (tokens that print alike share a key)
            check_top(sorted(top.values(), reverse=True), row)


def _structured(client, i: int, schema):
    fmt = ({"type": "json_object"} if schema is None else
           {"type": "json_schema", "json_schema": {"name": f"thing_{i}", "schema": schema, "strict": True}})
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.8, seed=i, response_format=fmt)
    if i % 2:  # half of them streamed
        text, reason = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason
    choice = client.chat.completions.create(**kw).choices[0]
    return choice.message.content, choice.finish_reason


def _free(client, i: int):
    reply = client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].text, reply.choices[0].finish_reason


def test_structured_replies_validate_under_concurrency(client, served, oracle):  # noqa: F811
    schemas = SCHEMAS * 2
    with ThreadPoolExecutor(10) as pool:
        constrained = [pool.submit(_structured, client, i, schema) for i, schema in enumerate(schemas)]
        free = [pool.submit(_free, client, i) for i in range(4)]
        results = [job.result(timeout=300) for job in constrained]
        texts = [job.result(timeout=300) for job in free]
    for (text, reason), schema in zip(results, schemas):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    # The free requests that shared those batches got what they get alone.
    assert texts == [(oracle(f"request {i}", 20).text, "length") for i in range(4)]


def test_json_object_replies_are_objects(client):
    """A random model writes long strings: most replies hit max_tokens; those that end are
    objects (greedy on "prompt 2" ends), and the rest are the start of one."""
    reasons = []
    for i in range(4):
        choice = client.completions.create(model=MODEL, prompt=f"prompt {i}", max_tokens=200, temperature=0,
                                           extra_body={"response_format": {"type": "json_object"}}).choices[0]
        reasons.append(choice.finish_reason)
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.text.startswith('{"')
    assert "stop" in reasons


@pytest.mark.parametrize(
    "kw, param, message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}},
         "response_format", "Invalid type: strang"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
        ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    ],
)
def test_bad_values_are_400s_naming_the_field(client, kw, param, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kw)
    error = raised.value.body
    assert error["param"] == param and message in error["message"]


def test_completions_logprobs_above_five_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="from 0 to 5"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=6)
