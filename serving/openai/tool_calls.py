"""Tool calls in generated text: which format a chat template asks for, and the calls
parsed out of a model's reply, whole or as it streams.

Two formats, told apart by the template's own text:

``hermes`` (Hermes, Qwen 2/2.5/3 and most templates that render ``tools``)
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them,
    among ordinary text.
``llama3-json`` (Llama 3.1 / 3.2 / 3.3)
    The whole reply is one call ``{"name": ..., "parameters": {...}}`` (or several joined
    by ``;``), optionally after ``<|python_tag|>``.

``ToolCallStream`` parses text as it arrives: text that cannot be part of a call is
released at once, a call once it is complete. A block that does not parse as a call is
released as text, so a reply is never lost. ``parse_reply`` runs the same stream over a
whole reply, so a streamed and a whole reply always agree.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

HERMES, LLAMA3_JSON = "hermes", "llama3-json"
FORMATS = (HERMES, LLAMA3_JSON)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolsUnsupported(ValueError):
    """The model's chat template cannot render tools, or its call format is not one parsed here."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of an object, as OpenAI returns it."""

    name: str
    arguments: str
    id: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Piece = Union[str, ToolCall]  # what a stream releases: text, or a complete call


def template_format(source: str) -> str:
    """The tool-call format of a chat template, from its text.

    Raises:
        ToolsUnsupported: the template never reads ``tools``, or it does but writes calls
            in a format not parsed here.
    """
    if not re.search(r"\btools\b", source):
        raise ToolsUnsupported("this model's chat template does not render tools, so it cannot call them; "
                               "remove 'tools' (and 'tool_choice')")
    if HERMES_OPEN in source:
        return HERMES
    if PYTHON_TAG in source or ('"parameters"' in source and "<|start_header_id|>" in source):
        return LLAMA3_JSON
    raise ToolsUnsupported("this model's chat template renders tools, but in a call format this server does "
                           "not parse (it parses Hermes/Qwen <tool_call> JSON and Llama-3 JSON); remove 'tools'")


def call_marker(fmt: str) -> Optional[str]:
    """The text that opens a call in ``fmt``, if the parser needs to see it (Llama-3 calls
    parse without their ``<|python_tag|>``)."""
    return HERMES_OPEN if fmt == HERMES else None


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(value: Any, arguments_key: str) -> Optional[ToolCall]:
    """A call from a parsed JSON value ``{"name": str, <arguments_key>: object}``, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), _new_id())


def _hermes_call(body: str) -> Optional[ToolCall]:
    try:
        return _call(json.loads(body), "arguments")
    except ValueError:
        return None


def _llama3_calls(text: str) -> Optional[list[ToolCall]]:
    """Every call of a Llama-3 JSON reply (objects joined by ``;``), or None if it is not one."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call(value, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None
        at = len(text) - len(rest)
    return calls or None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (a marker cut short)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """Releases a reply's text and tool calls as the text arrives.

    ``feed(text)`` and ``finish()`` return the pieces that became final, in order.
    Whitespace before a call, and after the last one at the end, is dropped (a model
    separates calls by newlines); text without calls comes out exactly as it went in.
    Calls past ``max_calls`` are dropped (``parallel_tool_calls: false`` asks for one).
    """

    def __init__(self, fmt: str, max_calls: Optional[int] = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
        self.format = fmt
        self._buffer = ""
        self._inside = False  # hermes: within <tool_call>...; llama3: the reply is JSON
        self._decided = fmt == HERMES  # llama3: whether the reply is JSON or text is known
        self._space = ""  # whitespace held back: dropped if a call follows
        self._after_call = False
        self._max_calls = max_calls
        self.calls = 0  # released so far

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        if self.format == HERMES:
            self._hermes(out)
        else:
            self._llama3(out)
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        rest, self._buffer = self._buffer, ""
        if self.format == HERMES and self._inside:  # a call cut short by the end (e.g. a stop string)
            self._emit_call(out, _hermes_call(rest), HERMES_OPEN + rest)
        elif self.format == LLAMA3_JSON and self._inside:
            calls = _llama3_calls(rest)
            if calls is None:
                self._emit_text(out, rest)
            for call in calls or ():
                self._emit_call(out, call, rest)
        else:
            self._emit_text(out, rest)
        self._end(out)
        return out

    def _hermes(self, out: list[Piece]) -> None:
        while True:
            if not self._inside:
                at = self._buffer.find(HERMES_OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, HERMES_OPEN)
                    self._emit_text(out, self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                self._emit_text(out, self._buffer[:at])
                self._buffer, self._inside = self._buffer[at + len(HERMES_OPEN):], True
            end = self._buffer.find(HERMES_CLOSE)
            if end < 0:
                return
            body = self._buffer[:end]
            self._buffer, self._inside = self._buffer[end + len(HERMES_CLOSE):], False
            self._emit_call(out, _hermes_call(body), HERMES_OPEN + body + HERMES_CLOSE)

    def _llama3(self, out: list[Piece]) -> None:
        if not self._decided:
            start = self._buffer.lstrip()
            if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
                return  # nothing yet, or the tag cut short
            self._decided, self._inside = True, start.startswith(("{", PYTHON_TAG))
        if not self._inside:
            self._emit_text(out, self._buffer)
            self._buffer = ""

    def _emit_call(self, out: list[Piece], call: Optional[ToolCall], text: str) -> None:
        if call is None:  # not a call after all: it is text
            self._emit_text(out, text)
            return
        self._space, self._after_call = "", True
        if self._max_calls is None or self.calls < self._max_calls:
            out.append(call)
            self.calls += 1

    def _emit_text(self, out: list[Piece], text: str) -> None:
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            out.append(body)
            self._after_call = False

    def _end(self, out: list[Piece]) -> None:
        """Release the whitespace held back, unless it only trails a call."""
        if self._space and not self._after_call:
            out.append(self._space)
        self._space = ""


@dataclass(frozen=True)
class ParsedReply:
    """A whole reply split into its text (None if there is none) and its calls."""

    content: Optional[str]
    calls: tuple[ToolCall, ...]


def parse_reply(fmt: str, text: str, max_calls: Optional[int] = None) -> ParsedReply:
    stream = ToolCallStream(fmt, max_calls)
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return ParsedReply(content or None, tuple(p for p in pieces if isinstance(p, ToolCall)))
