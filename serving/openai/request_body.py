"""Request bodies read within limits and parsed as JSON that the schema code can trust.

The body is read as it arrives, never past ``max_bytes`` (a declared Content-Length over
the limit is refused before reading), and the whole of it must arrive within ``timeout``
seconds of the app starting to read it (a deadline for the body, not for each chunk, so a
client trickling a byte at a time cannot hold a connection past it). Parsing refuses what Python's ``json`` accepts but no client means: NaN and
Infinity, numbers past float range, integers of more than ``MAX_INT_DIGITS`` digits
(Python refuses > 4300 digits with a ValueError) and nesting past the interpreter's
recursion limit; ``check_value`` then refuses nesting deeper than ``MAX_DEPTH`` and lone
UTF-16 surrogates (``"\\ud800"``), which no tokenizer can encode.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 30.0
# The connection around a body: a request's headers must arrive within DEFAULT_HEADER_TIMEOUT
# seconds (slow_clients), and an idle keep-alive connection closes after DEFAULT_KEEP_ALIVE.
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE = 5.0  # uvicorn's default
MAX_INT_DIGITS = 30  # any integer field the API has fits in far fewer
MAX_DEPTH = 32  # the deepest a valid request goes is 4 (messages[i].content[j].text)


class BodyError(ValueError):
    """A body refused before it reaches the schema; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ClientGone(Exception):
    """The client disconnected before its body was complete."""


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeout: float = DEFAULT_BODY_TIMEOUT  # seconds the whole body may take to arrive


async def read_body(receive: Callable[[], Awaitable[dict]], headers: dict, limits: BodyLimits) -> bytes:
    """The whole body from the ASGI ``receive``, within ``limits``.

    Raises:
        BodyError: 413 past the size limit, 408 when the body is not complete by its
            deadline, 400 for a bad Content-Length.
        ClientGone: the client disconnected.
    """
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.isdigit() or len(declared) > 20:
            raise BodyError(400, f"Content-Length {declared[:40]!r} is not a byte count")
        if int(declared) > limits.max_bytes:
            raise BodyError(413, _too_large(limits.max_bytes), "request_too_large")
    chunks, size, more = [], 0, True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.timeout
    while more:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise BodyError(408, f"the request body did not arrive within {limits.timeout:g} s "
                                 "(serve --body-timeout)", "request_timeout") from None
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limits.max_bytes:
            raise BodyError(413, _too_large(limits.max_bytes), "request_too_large")
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes (serve --max-body-bytes)"


def parse_json(body: bytes) -> Any:
    """The JSON value of ``body``.

    Raises:
        BodyError: 400, with a message naming what is wrong.
    """
    try:
        text = body.decode("utf-8")
        value = json.loads(text, parse_constant=_no_constant, parse_int=_int, parse_float=_float)
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"the request body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise BodyError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except BodyError:
        raise
    except ValueError as exc:  # json.JSONDecodeError included
        raise BodyError(400, f"the request body is not valid JSON ({exc})") from None
    return value


def _no_constant(name: str) -> Any:
    raise BodyError(400, f"the request body is not valid JSON ({name} is not a JSON number)")


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise BodyError(400, f"the request body holds an integer of {len(digits)} digits; "
                             f"numbers here have at most {MAX_INT_DIGITS}")
    return int(digits)


def _float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise BodyError(400, f"the number {literal[:40]} is out of range")
    return value


def check_value(value: Any) -> None:
    """Refuse nesting past ``MAX_DEPTH`` and strings that are not valid Unicode text.

    Iterative, so a deep value cannot exhaust the stack here either.
    """
    stack = [(value, 1, "body")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, (list, dict)):
            if depth > MAX_DEPTH:
                raise BodyError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, where)
                    stack.append((child, depth + 1, key if where == "body" else where))
            else:
                stack.extend((child, depth + 1, where) for child in item)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BodyError(400, f"'{where}' holds a lone UTF-16 surrogate ({text[exc.start]!r} at index "
                             f"{exc.start}); send valid Unicode text") from None
