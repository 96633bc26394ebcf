"""Parsing response_format and logprobs fields; the OpenAI logprobs shapes."""
from __future__ import annotations

import math

import pytest

from mlx_pte.serving.sampling.grammar import Grammar
from mlx_pte.serving.sampling.logprobs import TokenLogprob
from mlx_pte.serving.openai.output_options import (
    FLOOR_LOGPROB,
    chat_logprobs,
    completion_logprobs,
    parse_logprobs,
    parse_response_format,
)
from mlx_pte.serving.openai.request_fields import FieldError


def test_response_formats():
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == Grammar.json_object()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert parse_response_format(spec) == Grammar.json_schema(schema)


@pytest.mark.parametrize(
    "value, message",
    [
        ("json", "must be an object with a string 'type'"),
        ({"type": "yaml"}, "got 'yaml'"),
        ({"type": "json_object", "schema": {}}, "takes no field 'schema'"),
        ({"type": "json_schema"}, "must be an object with 'name' and 'schema'"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name' must be 1 to 64"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "name' must be 1 to 64"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}, "strict' must be"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}, "must be a JSON Schema object"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}}, "no field 'extra'"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strang"}}}, "Invalid type: strang"),
    ],
)
def test_bad_response_formats_name_the_problem(value, message):
    with pytest.raises(FieldError, match=message) as raised:
        parse_response_format(value)
    assert raised.value.param == "response_format"


@pytest.mark.parametrize(
    "body, chat, expected",
    [
        ({}, True, None), ({"logprobs": False}, True, None), ({"logprobs": True}, True, 0),
        ({"logprobs": True, "top_logprobs": 20}, True, 20), ({}, False, None), ({"logprobs": 0}, False, 0),
        ({"logprobs": 5}, False, 5),
    ],
)
def test_logprob_counts(body, chat, expected):
    assert parse_logprobs(body, chat) == expected


@pytest.mark.parametrize(
    "body, chat, param",
    [
        ({"logprobs": 1}, True, "logprobs"), ({"top_logprobs": 2}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 1.5}, True, "top_logprobs"),
        ({"logprobs": 6}, False, "logprobs"), ({"logprobs": True}, False, "logprobs"),
        ({"logprobs": -1}, False, "logprobs"), ({"top_logprobs": 1}, False, "top_logprobs"),
    ],
)
def test_bad_logprob_counts_name_their_field(body, chat, param):
    with pytest.raises(FieldError) as raised:
        parse_logprobs(body, chat)
    assert raised.value.param == param


class _Bytes:
    table = {1: b"ab", 2: "é".encode()[:1], 3: "é".encode()[1:], 4: b"c"}

    def token_bytes(self, token):
        return self.table[token]


def test_chat_shape_and_finite_logprobs():
    records = [TokenLogprob(1, -0.5, ((1, -0.5), (4, -math.inf))), TokenLogprob(2, -1.0)]
    shaped = chat_logprobs(records, _Bytes())
    assert shaped == {"refusal": None, "content": [
        {"token": "ab", "logprob": -0.5, "bytes": [97, 98], "top_logprobs": [
            {"token": "ab", "logprob": -0.5, "bytes": [97, 98]},
            {"token": "c", "logprob": FLOOR_LOGPROB, "bytes": [99]}]},
        {"token": "\ufffd", "logprob": -1.0, "bytes": [0xC3], "top_logprobs": []},
    ]}


def test_completion_shape_counts_offsets_in_characters():
    records = [TokenLogprob(1, -0.1), TokenLogprob(2, -0.2), TokenLogprob(3, -0.3), TokenLogprob(4, -0.4, ((4, -0.4),))]
    shaped = completion_logprobs(records, _Bytes())
    assert shaped["text_offset"] == [0, 2, 2, 3]  # "ab", then "é" in two tokens, then "c"
    assert shaped["token_logprobs"] == [-0.1, -0.2, -0.3, -0.4]
    assert shaped["top_logprobs"] == [{}, {}, {}, {"c": -0.4}]
    later = completion_logprobs(records[3:], _Bytes(), before=b"ab\xc3\xa9")
    assert later["text_offset"] == [3]
