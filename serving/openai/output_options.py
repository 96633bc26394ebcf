"""The OpenAI request fields that shape what a completion returns besides its text:
``response_format`` (structured output) and ``logprobs`` / ``top_logprobs``; and the
``logprobs`` objects of the responses.

Parsing needs no engine (a bad value is a ``FieldError`` naming its field, which the
server answers with 400); shaping turns the engine's ``TokenLogprob`` records into
OpenAI's chat shape (``{"content": [{token, logprob, bytes, top_logprobs}]}``) or the
legacy completions shape (``{tokens, token_logprobs, top_logprobs, text_offset}``).
"""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence

from ..sampling.grammar import Grammar, GrammarError
from .request_fields import FieldError

if TYPE_CHECKING:
    from ..sampling.logprobs import TokenLogprob

# OpenAI's bounds: chat's top_logprobs, and legacy completions' logprobs.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# What OpenAI reports for a token the model cannot take (JSON has no -inf).
FLOOR_LOGPROB = -9999.0
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def parse_response_format(value: Any) -> Optional[Grammar]:
    """The grammar ``response_format`` asks for (None: free text).

    ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"?, "description"?}}``; the schema is
    enforced whether ``strict`` is true or not, so a reply always validates.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FieldError("response_format", "'response_format' must be an object with a string 'type'")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"})
    if extra:
        raise FieldError("response_format", f"'response_format' of type {kind!r} takes no field {extra[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise FieldError("response_format", f"'response_format.type' must be 'text', 'json_object' or "
                                             f"'json_schema', got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError("response_format", "'response_format.json_schema' must be an object with 'name' and 'schema'")
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise FieldError("response_format", f"'response_format.json_schema' takes no field {unknown[0]!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise FieldError("response_format", "'response_format.json_schema.name' must be 1 to 64 letters, "
                                             "digits, '_' or '-'")
    if spec.get("strict") not in (None, True, False):
        raise FieldError("response_format", "'response_format.json_schema.strict' must be true or false")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise FieldError("response_format", "'response_format.json_schema.description' must be a string")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise FieldError("response_format", "'response_format.json_schema.schema' must be a JSON Schema object")
    try:
        return Grammar.json_schema(schema)
    except GrammarError as exc:
        raise FieldError("response_format", f"'response_format.json_schema.schema': {exc}") from None


def parse_logprobs(body: Mapping[str, Any], chat: bool) -> Optional[int]:
    """How many top tokens to report beside each drawn token's log-probability (None:
    no log-probabilities). Chat: ``logprobs`` true/false and ``top_logprobs`` 0..20 (only
    with ``logprobs``); completions: ``logprobs`` 0..5."""
    value = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if value is not None and not isinstance(value, bool):
            raise FieldError("logprobs", f"'logprobs' must be true or false, got {value!r}")
        if top is not None and not value:
            raise FieldError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        if not value:
            return None
        return _count(top, "top_logprobs", MAX_TOP_LOGPROBS) if top is not None else 0
    if body.get("top_logprobs") is not None:
        raise FieldError("top_logprobs", "completions take 'logprobs' (an integer 0..5), not 'top_logprobs'")
    return None if value is None else _count(value, "logprobs", MAX_COMPLETION_LOGPROBS)


def _count(value: Any, name: str, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise FieldError(name, f"'{name}' must be an integer from 0 to {most}, got {value!r}")
    return value


class TokenBytes(Protocol):
    def token_bytes(self, token: int) -> bytes: ...


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR_LOGPROB


def _entry(vocabulary: TokenBytes, token: int, logprob: float) -> dict:
    raw = vocabulary.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}


def chat_logprobs(records: Sequence["TokenLogprob"], vocabulary: TokenBytes) -> dict:
    """A chat choice's (or delta's) ``logprobs`` object."""
    content = []
    for record in records:
        entry = _entry(vocabulary, record.token, record.logprob)
        entry["top_logprobs"] = [_entry(vocabulary, t, v) for t, v in record.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(records: Sequence["TokenLogprob"], vocabulary: TokenBytes, before: bytes = b"") -> dict:
    """A legacy completion choice's ``logprobs`` object. ``text_offset`` is where each
    token's text starts in the choice's text; ``before``: the bytes of the choice's
    earlier tokens (a stream's earlier chunks)."""
    tokens, offsets, seen = [], [], before
    for record in records:
        offsets.append(len(seen.decode("utf-8", errors="ignore")))
        raw = vocabulary.token_bytes(record.token)
        seen += raw
        tokens.append(raw.decode("utf-8", errors="replace"))
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(r.logprob) for r in records],
        "top_logprobs": [
            {vocabulary.token_bytes(t).decode("utf-8", errors="replace"): _finite(v) for t, v in r.top}
            for r in records
        ],
        "text_offset": offsets,
    }
