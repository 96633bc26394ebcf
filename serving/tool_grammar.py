"""The grammar that makes a reply a tool call (``tool_choice`` "required" or a named
function): the call format's fixed text around one JSON object per call, whose ``name``
is a callable function's and whose arguments are an instance of that function's
``parameters`` schema. The format's parser (``tool_calls``) reads such a reply back.
"""
from __future__ import annotations

import json

from .grammar import Grammar, GrammarError, json_schema_rule
from .request_fields import FieldError
from .tool_calls import HERMES, HERMES_CLOSE, HERMES_OPEN
from .tool_request import ToolUse

def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


def _call_schema(name: str, parameters: dict, arguments_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def tool_call_grammar(use: ToolUse) -> Grammar:
    """The grammar of a reply that is only calls, as ``use`` asks (one call, or one or more).

    Raises:
        FieldError: for ``tools``: a function's ``parameters`` schema the grammar engine
            cannot enforce, naming the function.
    """
    hermes = use.format == HERMES
    rules, alternatives = [], []
    for i, (name, parameters) in enumerate(use.schemas().items()):
        try:
            Grammar.json_schema(parameters)  # checked alone, so that a refusal names its function
        except GrammarError as exc:
            raise FieldError("tools", f"the parameters of function {name!r} cannot be enforced: {exc}") from None
        rule = json_schema_rule(_call_schema(name, parameters, "arguments" if hermes else "parameters"))
        rules.append(f"f{i}: {rule}")
        alternatives.append(f"f{i}")
    opening, closing = _lark_string(HERMES_OPEN + "\n"), _lark_string("\n" + HERMES_CLOSE)
    call = f"{opening} body {closing}" if hermes else "body"
    # Several calls are joined as models write them: a newline between Hermes blocks, "; "
    # between Llama-3 objects.
    separator = _lark_string("\n" if hermes else "; ")
    start = "call" if use.max_calls == 1 else f"call ({separator} call)*"
    text = "\n".join([f"start: {start}", f"call: {call}", f"body: {' | '.join(alternatives)}", *rules]) + "\n"
    return Grammar.lark(text)
