"""OpenAI chat messages checked and turned into what a chat template reads.

A template gets what Hugging Face's ``apply_chat_template`` gives it for the same
conversation: ``role`` and ``content`` (text parts joined), ``name`` when given, an
assistant's ``tool_calls`` with their ``arguments`` as objects (OpenAI sends them as JSON
text; templates write them with ``tojson``), and a tool message's ``tool_call_id``.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from .request_fields import FieldError, check_keys

MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
# What a client sends back when it appends the server's own reply message: nothing to render.
MESSAGE_NO_OP = {"refusal": (None,), "audio": (None,), "function_call": (None,), "annotations": (None, [])}
TOOL_CALL_FIELDS = frozenset({"id", "type", "function"})
CALLED_FUNCTION_FIELDS = frozenset({"name", "arguments"})


def _fail(message: str) -> FieldError:
    return FieldError("messages", message)


def _text(content: Any, where: str, allow_null: bool) -> str:
    if content is None and allow_null:
        return ""
    if isinstance(content, list):  # content parts: only text is understood
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise _fail(f"{where}.content may hold only text parts")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _fail(f"{where}.content must be a string" + (" or null" if allow_null else ""))
    return content


def _tool_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise _fail(f"{where} must be an object with 'id', 'type': 'function' and 'function'")
    check_keys(call, TOOL_CALL_FIELDS, {}, where, "messages")
    function = call["function"]
    check_keys(function, CALLED_FUNCTION_FIELDS, {}, f"{where}.function", "messages")
    if call.get("type", "function") != "function":
        raise _fail(f"{where}.type must be 'function'")
    if not isinstance(call.get("id"), str):
        raise _fail(f"{where}.id must be a string")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise _fail(f"{where}.function.name must be a non-empty string")
    arguments = function.get("arguments")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise _fail(f"{where}.function.arguments must be the JSON text of an object")
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": parsed}}


def _message(message: Any, where: str) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _fail(f"{where} must be an object with a string 'role'")
    check_keys(message, MESSAGE_FIELDS, MESSAGE_NO_OP, where, "messages")
    role = message["role"]
    calls: Optional[list] = message.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise _fail(f"{where}.tool_calls must be a list, on an assistant message")
    out: dict = {"role": role, "content": _text(message.get("content"), where, allow_null=bool(calls))}
    if message.get("name") is not None:
        if not isinstance(message["name"], str):
            raise _fail(f"{where}.name must be a string")
        out["name"] = message["name"]
    if calls:
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise _fail(f"{where}.tool_call_id must be the id of the call this message answers")
        out["tool_call_id"] = message["tool_call_id"]
    elif message.get("tool_call_id") is not None:
        raise _fail(f"{where}.tool_call_id belongs on a message of role 'tool'")
    return out


def template_messages(messages: Any) -> list[dict]:
    """The conversation as the chat template reads it.

    Raises:
        FieldError: for ``messages``, naming the message and what is wrong.
    """
    if not isinstance(messages, list) or not messages:
        raise _fail("'messages' must be a non-empty list of {role, content} objects")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
