"""Request-schema fuzzing against a live server: random JSON values for every field.

Whatever a client sends, the answer is a 200 or an OpenAI-shaped 4xx, never a 500, a
dropped connection or a hang, and a normal request on the same connection succeeds
afterwards. The oracle is the HTTP contract itself (status class and error shape).
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mlx_pte.serving.engine import Engine
from mlx_pte.serving.openai.app import create_app
from tests.serving.live_server import serving

TIMEOUT = 60.0
NORMAL = {"prompt": "x", "max_tokens": 1}

# Any JSON value, biased toward the edges: lone surrogates, huge and negative numbers,
# deep-ish nesting, empty containers.
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2, 255, 256, 2**63 - 1, 2**63, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 1e-320, 5e-324, 1e308, 0.5, 1.0]),
    st.text(max_size=12), st.sampled_from(["\ud800", "hi\udfff", "", "user", "assistant", "text"]),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)
# Plausible values per field, so fuzzing reaches past the first type check.
token_counts = st.one_of(st.integers(-2, 40), json_values)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), json_values),
                                 "content": st.one_of(st.text(max_size=20), json_values)})
COMMON = {
    "model": st.one_of(st.just("tiny"), json_values),
    "max_tokens": token_counts,
    "temperature": st.one_of(st.floats(0, 3), json_values),
    "top_p": st.one_of(st.floats(0, 1), json_values),
    "top_k": st.one_of(st.integers(-1, 50), json_values),
    "seed": st.one_of(st.integers(-5, 2**64), json_values),
    "n": st.one_of(st.integers(-1, 4), json_values),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_values}), json_values),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 6), json_values),
    "top_logprobs": st.one_of(st.integers(-1, 21), json_values),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                              optional={"json_schema": st.fixed_dictionaries(
                                  {"name": st.sampled_from(["a", "b c", ""])}, optional={"schema": json_values})}),
        json_values),
    "echo": json_values,
    "presence_penalty": json_values,
    "frequency_penalty": json_values,
    "user": json_values,
}
COMPLETION = {**COMMON, "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 1100), max_size=8),
                                            json_values)}
function = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["f", "g"]), json_values)},
                                 optional={"parameters": json_values, "strict": json_values, "x": json_values})
tool = st.fixed_dictionaries({"type": st.one_of(st.just("function"), json_values), "function": function})
tool_call = st.fixed_dictionaries({"id": st.one_of(st.just("c"), json_values), "type": st.just("function"),
                                   "function": st.fixed_dictionaries({"name": json_values, "arguments": st.one_of(
                                       st.sampled_from(['{"a": 1}', "{", "[]"]), json_values)})})
turn = st.one_of(message, st.fixed_dictionaries({"role": st.sampled_from(["assistant", "tool", "user"]),
                                                 "content": st.one_of(st.none(), st.text(max_size=5))},
                                                optional={"tool_calls": st.lists(tool_call, max_size=2),
                                                          "tool_call_id": json_values, "refusal": json_values}))
CHAT = {**COMMON, "messages": st.one_of(st.lists(turn, max_size=3), json_values),
        "max_completion_tokens": token_counts,
        "tools": st.one_of(st.lists(tool, max_size=2), json_values),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                                 st.fixed_dictionaries({"type": st.just("function"),
                                                        "function": st.fixed_dictionaries({"name": json_values})}),
                                 json_values),
        "parallel_tool_calls": json_values}


def bodies(fields: dict) -> st.SearchStrategy:
    """A JSON object with a random subset of the endpoint's fields, or any JSON value."""
    subset = st.fixed_dictionaries({}, optional=fields)
    return st.one_of(subset, subset, subset, json_values)


@pytest.fixture(scope="module")
def client(program):
    engine = Engine(program, "batched-cell", capacity=400, max_batch_tokens=16)
    with serving(create_app(engine, "tiny")) as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            yield c
    assert engine.cache.live_seqs() == ()


def check(client: httpx.Client, path: str, body) -> None:
    raw = json.dumps(body).encode()  # \u escapes: lone surrogates travel as clients send them
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300], raw[:300])
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert client.post("/v1/completions", json=NORMAL).status_code == 200


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(body=bodies(COMPLETION))
def test_completions_fuzz(client, body):
    check(client, "/v1/completions", body)


@FAST
@given(body=bodies(CHAT))
def test_chat_completions_fuzz(client, body):
    check(client, "/v1/chat/completions", body)


@pytest.mark.slow
@SLOW
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
def test_request_schema_fuzz_long(client, path, data):
    check(client, path, data.draw(bodies(COMPLETION if path == "/v1/completions" else CHAT)))
