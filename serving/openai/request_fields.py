"""Which request fields each endpoint takes: an allow-list, so that a field the server does
not implement is a 400 naming it, never silently ignored.

Each endpoint lists the fields it implements (any value its parser accepts). An OpenAI
field the server does not implement is still taken at a value that asks for nothing (its
"no-op" values: null, or the API's default, such as 0 for a penalty); any other value is
refused, naming the field. Every other name is refused. To implement a field, add its
name to the endpoint's set (and parse it); the no-op entry may stay, since implemented
fields are checked first.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

# Every generating endpoint implements these.
_GENERATION = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
    "stream_options", "ignore_eos",
    "user",  # an end-user id for the caller's own bookkeeping: taken (a string), not used
})
CHAT_FIELDS = _GENERATION | {
    "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
    "logprobs", "top_logprobs", "response_format",
    "metadata",  # tags for stored completions (this server stores none): taken (an object), not used
}
COMPLETION_FIELDS = _GENERATION | {"prompt", "logprobs", "response_format"}
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
# The keys of ``stream_options`` the server implements.
STREAM_OPTIONS_FIELDS = frozenset({"include_usage"})

# OpenAI fields not implemented here, with the values that ask for nothing (compared by
# type as well as value: ``false`` is not ``0``).
NO_OP_VALUES: Mapping[str, tuple[Any, ...]] = {
    "top_logprobs": (None,),  # completions take logprobs=k instead
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
}


class FieldError(ValueError):
    """A request field the endpoint does not take, or a bad value of one (``param`` names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _same(value: Any, expected: Any) -> bool:
    """JSON equality that tells booleans from numbers (``0 == False`` in Python)."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return value is expected
    if isinstance(expected, (int, float)):
        return isinstance(value, (int, float)) and value == expected
    if isinstance(expected, list):
        return isinstance(value, list) and len(value) == len(expected) and all(map(_same, value, expected))
    if isinstance(expected, dict):
        return (isinstance(value, dict) and value.keys() == expected.keys()
                and all(_same(value[k], expected[k]) for k in expected))
    return type(value) is type(expected) and value == expected


def _no_op_text(values: tuple[Any, ...]) -> str:
    shown = [json.dumps(v) for v in values if v is not None]
    return f"; remove it or set it to {' or '.join(shown)}" if shown else "; remove it"


def check_fields(body: Mapping[str, Any], implemented: frozenset[str], endpoint: str) -> None:
    """Refuse the first field of ``body`` (in sorted order) that ``endpoint`` does not take.

    Raises:
        FieldError: naming the field and what to do.
    """
    for name in sorted(body):
        if name not in implemented:
            _refuse_unless_no_op(name, name, body[name], NO_OP_VALUES, name, f"a field {endpoint} takes")
    options = body.get("stream_options")
    if "stream_options" in implemented and isinstance(options, dict):
        check_keys(options, STREAM_OPTIONS_FIELDS, {}, "stream_options", "stream_options")


def check_keys(value: Mapping[str, Any], implemented: frozenset[str], no_op: Mapping[str, tuple[Any, ...]],
               where: str, param: str) -> None:
    """Refuse the first key of the object ``value`` (found at ``where``, e.g. ``messages[2]``)
    that is neither implemented nor at one of its ``no_op`` values.

    Raises:
        FieldError: for request field ``param``, naming ``where.key``.
    """
    for name in sorted(value):
        if name not in implemented:
            _refuse_unless_no_op(name, f"{where}.{name}", value[name], no_op, param, f"a key '{where}' takes")


def _refuse_unless_no_op(key: str, name: str, value: Any, no_op: Mapping[str, tuple[Any, ...]], param: str,
                         what: str) -> None:
    """``key`` of an object, shown as ``name``: refused unless ``no_op`` lists it and ``value`` is a no-op."""
    if key in no_op:
        values = no_op[key]
        if not any(_same(value, v) for v in values):
            raise FieldError(param, f"'{name}' is not supported by this server{_no_op_text(values)}")
        return
    raise FieldError(param, f"'{name}' is not {what} on this server; remove it "
                            "(README, section Serving, lists what each endpoint takes)")
