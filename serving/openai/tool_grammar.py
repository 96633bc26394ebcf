"""The grammars that keep a reply's tool calls valid: each call is the format's fixed text
around one JSON object whose ``name`` is a callable function's and whose arguments are an
instance of that function's ``parameters`` schema. The format's parser (``tool_calls``)
reads such a reply back.

Forced (``tool_choice`` "required" or a named function): the reply is calls only.
Strict (``tool_choice`` "auto" with a ``strict`` function): the reply is free text, or
calls that validate: Hermes text may not contain ``<tool_call>`` unless a valid call
follows it; a Llama-3 reply that begins with ``{`` must be calls.
"""
from __future__ import annotations

import json
from typing import Optional

from ..sampling.grammar import Grammar, GrammarError, json_schema_rule
from .request_fields import FieldError
from .tool_calls import HERMES, HERMES_CLOSE, HERMES_OPEN
from .tool_request import ToolUse


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


def _call_schema(name: str, parameters: dict, arguments_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def _bodies(use: ToolUse, arguments_key: str) -> list[str]:
    """One Lark rule per callable function (``f0: %json {...}``); the refusal names the function."""
    rules = []
    for i, (name, parameters) in enumerate(use.schemas().items()):
        try:
            Grammar.json_schema(parameters)  # checked alone, so that a refusal names its function
        except GrammarError as exc:
            raise FieldError("tools", f"the parameters of function {name!r} cannot be enforced: {exc}") from None
        rules.append(f"f{i}: {json_schema_rule(_call_schema(name, parameters, arguments_key))}")
    return rules


def tool_call_grammar(use: ToolUse) -> Optional[Grammar]:
    """The grammar ``use`` asks for: forced calls, free text or valid calls (strict), or
    None (calls are only parsed).

    Raises:
        FieldError: for ``tools``: a function's ``parameters`` schema the grammar engine
            cannot enforce, naming the function.
    """
    if not (use.enforced or use.strict):
        return None
    hermes = use.format == HERMES
    rules = _bodies(use, "arguments" if hermes else "parameters")
    body = " | ".join(rule.split(":", 1)[0] for rule in rules)
    newline = _lark_string("\n")
    opening, closing = _lark_string(HERMES_OPEN + "\n"), _lark_string("\n" + HERMES_CLOSE)
    call = f"{opening} body {closing}" if hermes else "body"
    # Several calls are joined as models write them: a newline between Hermes blocks, "; "
    # between Llama-3 objects.
    more = "" if use.max_calls == 1 else f" ({newline if hermes else _lark_string('; ')} call)*"
    if use.enforced:
        start = [f"start: call{more}"]
    elif hermes:  # text up to the first <tool_call> (which the call then completes), or text without one
        start = [f"start: TEXT | text_before {newline} body {closing}{more}",
                 "TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
                 f"text_before[stop={_lark_string(HERMES_OPEN)}]: /(?s:.*)/"]
    else:  # a reply that begins with { is calls
        start = [f"start: TEXT | call{more}", r"TEXT: /(?s:.*)/ & ~/(?s:\s*\{.*)/"]
    text = "\n".join([*start, f"call: {call}", f"body: {body}", *rules]) + "\n"
    return Grammar.lark(text)
